"""vLLM's ``--enable-ssl-refresh``: the server's TLS context reloads its certificate files when
they change, so a rotated certificate serves new connections without a restart (connections
open keep theirs)."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from pathlib import Path

logger = logging.getLogger(__name__)

POLL_SECONDS = 1.0


class CertificateRefresher:
    """Watches the key, certificate and CA files (by modification time and size) and loads them
    into ``context`` when they change. A load that fails (a key and certificate caught mid-way
    through a rotation) is logged and tried again at every poll until one succeeds; until then
    the context keeps what it had."""

    def __init__(
        self,
        context: ssl.SSLContext,
        keyfile: str | os.PathLike[str],
        certfile: str | os.PathLike[str],
        ca_certs: str | os.PathLike[str] | None,
    ) -> None:
        self.context = context
        self.keyfile, self.certfile, self.ca_certs = keyfile, certfile, ca_certs
        self._seen = self._stamps()
        self._failed = False

    def _stamps(self) -> list[tuple[int, int] | None]:
        """(mtime, size) of each file (None: not given, or gone)."""
        stamps: list[tuple[int, int] | None] = []
        for file in (self.keyfile, self.certfile, self.ca_certs):
            try:
                stat = os.stat(file) if file else None
            except OSError:
                stat = None
            stamps.append((stat.st_mtime_ns, stat.st_size) if stat else None)
        return stamps

    def check(self) -> bool:
        """Reload if a file changed (or the last reload failed); whether it reloaded."""
        stamps = self._stamps()
        if stamps == self._seen and not self._failed:
            return False
        self._seen = stamps
        try:
            self.context.load_cert_chain(self.certfile, self.keyfile)
            if self.ca_certs:
                self.context.load_verify_locations(self.ca_certs)
        except (OSError, ssl.SSLError, ValueError) as exc:
            if not self._failed:
                logger.warning("TLS files changed but do not load yet (%s); the server keeps "
                               "its certificate and tries again.", exc)  # fmt: skip
            self._failed = True
            return False
        self._failed = False
        logger.info("Reloaded the TLS certificate %s.", Path(self.certfile).name)
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(POLL_SECONDS)
            self.check()
