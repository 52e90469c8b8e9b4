"""MediaConnector: URLs (data:, http(s)://, file://) -> decoded images, audio and video.

Fetching is where a server meets hostile input, so the rules are strict by default:
- ``data:`` URLs are RFC 2397 base64 only, and their media type must be of the modality's family
  (``image/*`` for an image ...).
- ``http(s)://`` runs under one deadline per fetch (the modality's timeout covers DNS, connect,
  every redirect and the body) and a byte cap checked while streaming. The host must be in the
  allow-list when one is set. Its name is resolved here and every address must be public
  (loopback, private, link-local, multicast, reserved ... are refused unless
  ``allow_private_addresses``); the request then goes to the vetted address itself (Host header
  and TLS SNI keep the name), so DNS cannot answer differently between check and connect.
  Redirects are followed by hand, at most 5, and every hop is checked again.
- ``file://`` only resolves inside ``allowed_local_media_path`` (symlinks resolved first).
Failures raise ``MultiModalInputError``: stage "fetch" for getting the bytes, "decode" for
turning them into media (including a data URL of the wrong media type).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import ipaddress
import math
import socket
import ssl
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar
from urllib.parse import unquote, urlsplit

import httpx
import numpy as np
from PIL import Image

from omniserve import envs
from omniserve.multimodal.errors import MultiModalInputError
from omniserve.multimodal.media_io import (
    VideoBudget,
    VideoItem,
    decode_audio,
    decode_image,
    decode_video,
    media_io_knob,
)

if TYPE_CHECKING:
    from omniserve.config import MultiModalConfig

__all__ = ["MediaConfig", "MediaConnector", "VideoItem", "media_config"]

Modality = Literal["image", "audio", "video"]
T = TypeVar("T")

_MiB = 1 << 20
_MAX_REDIRECTS = 5
_REDIRECT_STATUSES = (301, 302, 303, 307, 308)
_NUM_DNS_THREADS = 4  # separate pool: a saturated loader pool must not starve DNS lookups


@dataclass(frozen=True)
class MediaConfig:
    """Limits and permissions for loading media. Every limit is checked before the work it
    bounds (bytes before reading, a header's size and duration before decoding)."""

    allowed_local_media_path: str | None = None
    """file:// URLs are served only from under this directory (None: file:// refused)."""
    allowed_media_domains: tuple[str, ...] = ()
    """Hosts http(s) URLs may name, matched exactly and case-insensitively (empty: any)."""
    allow_private_addresses: bool = False
    """Allow hosts that resolve to loopback/private/link-local/... addresses (tests, LANs)."""
    image_timeout_s: float = 5
    audio_timeout_s: float = 10
    video_timeout_s: float = 30
    image_max_bytes: int = 20 * _MiB
    audio_max_bytes: int = 50 * _MiB
    video_max_bytes: int = 200 * _MiB
    max_image_pixels: int = 50_000_000
    """Images (and video frames) above this many pixels are refused before decoding."""
    video_num_frames: int = 32
    """Frames sampled from a video when a request gives no num_frames (also caps fps sampling)."""
    max_audio_seconds: float = 600.0
    """Longest audio clip (or video audio track) accepted: resampling and featurizing scale
    with its duration, not its bytes (a 2 KB file declared at 1 Hz holds 2,000 s)."""
    max_video_seconds: float = 600.0
    max_video_frames: int = 18_000
    """Source frames decoded (all are, to sample some): ten minutes at 30 fps."""
    max_video_total_pixels: int = 18_000 * 640 * 480
    """Source frames times their pixels, the decoding work: ten minutes of 480p at 30 fps."""

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if item.type not in ("int", "float"):
                continue
            kind = int if item.type == "int" else (int, float)
            if isinstance(value, bool) or not isinstance(value, kind):
                raise ValueError(f"{self.describe(item.name)} must be a number > 0, got {value!r}")
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{self.describe(item.name)} must be > 0, got {value!r}")

    @classmethod
    def from_options(
        cls, media_io_kwargs: dict[str, Any] | None = None, **permissions: Any
    ) -> MediaConfig:
        """The server's media config: ``--media-io-kwargs`` (vLLM's flag, e.g.
        ``{"video": {"num_frames": 16, "max_seconds": 120}}``) and vLLM's fetch-timeout
        environment variables over the defaults."""
        values: dict[str, Any] = {}
        for modality in ("image", "audio", "video"):
            timeout = envs.media_fetch_timeout(modality)
            if timeout is not None:
                values[f"{modality}_timeout_s"] = timeout
        for modality, options in (media_io_kwargs or {}).items():
            keys = MEDIA_IO_KWARGS.get(modality)
            if keys is None:
                raise ValueError(
                    f"--media-io-kwargs: {modality!r} is not a modality; use "
                    f"{', '.join(MEDIA_IO_KWARGS)}."
                )
            if not isinstance(options, dict):
                raise ValueError(
                    f"--media-io-kwargs: {modality!r} must map to an object of "
                    f"options, got {options!r}."
                )
            for key, value in options.items():
                if key not in keys:
                    raise ValueError(
                        f"--media-io-kwargs: {modality}.{key} is not an option; "
                        f"{modality} takes {', '.join(keys)}."
                    )
                values[keys[key]] = value
        return cls(**permissions, **values)

    @staticmethod
    def describe(name: str) -> str:
        """A field as an operator sets it (its --media-io-kwargs entry, or the field name)."""
        for modality, keys in MEDIA_IO_KWARGS.items():
            for key, field_name in keys.items():
                if field_name == name:
                    return media_io_knob(modality, key)
        return name

    @property
    def video_budget(self) -> VideoBudget:
        return VideoBudget(
            max_frame_pixels=self.max_image_pixels,
            max_frames=self.max_video_frames,
            max_seconds=self.max_video_seconds,
            max_total_pixels=self.max_video_total_pixels,
            max_audio_seconds=self.max_audio_seconds,
        )


def media_config(mm: MultiModalConfig) -> MediaConfig:
    """The media rules an engine's config sets (``--media-io-kwargs`` and the URL permissions)."""
    return MediaConfig.from_options(
        mm.media_io_kwargs,
        allowed_local_media_path=mm.allowed_local_media_path,
        allowed_media_domains=mm.allowed_media_domains,
        allow_private_addresses=mm.allow_private_media_urls,
    )


MEDIA_IO_KWARGS: dict[str, dict[str, str]] = {
    "image": {"max_bytes": "image_max_bytes", "max_pixels": "max_image_pixels"},
    "audio": {"max_bytes": "audio_max_bytes", "max_seconds": "max_audio_seconds"},
    "video": {
        "num_frames": "video_num_frames",
        "max_bytes": "video_max_bytes",
        "max_seconds": "max_video_seconds",
        "max_frames": "max_video_frames",
        "max_total_pixels": "max_video_total_pixels",
    },
}
"""``--media-io-kwargs`` keys per modality -> the ``MediaConfig`` field each sets. The decoders'
error messages name these keys, so a refused item says how to raise its limit."""


class MediaConnector:
    """Loads media items from URLs or bytes under a ``MediaConfig``; thread-safe."""

    def __init__(self, config: MediaConfig = MediaConfig()) -> None:
        self.config = config
        self._local_root: Path | None = None
        if config.allowed_local_media_path is not None:
            root = Path(config.allowed_local_media_path).expanduser().resolve()
            if not root.is_dir():
                raise ValueError(f"--allowed-local-media-path {root} is not a directory.")
            self._local_root = root
        self._allowed_domains = frozenset(_normalize_host(d) for d in config.allowed_media_domains)

    # -- public API -----------------------------------------------------------------------------

    def fetch_image(self, url: str) -> Image.Image:
        """An RGB image from a URL."""
        return self.load_image_bytes(self._fetch_bytes(url, "image"))

    def fetch_audio(self, url: str) -> tuple[np.ndarray, int]:
        """(mono float32 waveform [num_samples], native sample rate) from a URL."""
        return self.load_audio_bytes(self._fetch_bytes(url, "audio"))

    def fetch_video(
        self, url: str, *, num_frames: int | None = None, fps: float | None = None
    ) -> VideoItem:
        """Sampled frames (and the audio track) of a video; see ``load_video_bytes``."""
        return self.load_video_bytes(
            self._fetch_bytes(url, "video"), num_frames=num_frames, fps=fps
        )

    async def fetch_image_async(self, url: str) -> Image.Image:
        return await _off_loop(self.fetch_image, url)

    async def fetch_audio_async(self, url: str) -> tuple[np.ndarray, int]:
        return await _off_loop(self.fetch_audio, url)

    async def fetch_video_async(
        self, url: str, *, num_frames: int | None = None, fps: float | None = None
    ) -> VideoItem:
        return await _off_loop(
            functools.partial(self.fetch_video, num_frames=num_frames, fps=fps), url
        )

    def load_image_bytes(self, data: bytes) -> Image.Image:
        self._check_size(len(data), "image", "the image")
        return decode_image(data, max_pixels=self.config.max_image_pixels)

    def load_audio_bytes(self, data: bytes) -> tuple[np.ndarray, int]:
        self._check_size(len(data), "audio", "the audio")
        return decode_audio(data, max_seconds=self.config.max_audio_seconds)

    def load_video_bytes(
        self, data: bytes, *, num_frames: int | None = None, fps: float | None = None
    ) -> VideoItem:
        """Decode a video: ``num_frames`` evenly spaced frames (default
        ``config.video_num_frames``), fewer when ``fps`` (frames per second of video) asks for
        fewer. The default cap also bounds fps sampling, so a long video cannot exhaust memory.
        The audio track stays at its native rate."""
        if num_frames is not None and (
            isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 1
        ):
            raise MultiModalInputError(
                f"num_frames must be an integer >= 1, got {num_frames!r}",
                stage="process",
                modality="video",
            )
        if fps is not None and (
            isinstance(fps, bool) or not isinstance(fps, int | float) or not fps > 0
        ):
            raise MultiModalInputError(
                f"fps must be a number > 0, got {fps!r}", stage="process", modality="video"
            )
        if num_frames is None:
            num_frames = self.config.video_num_frames
        self._check_size(len(data), "video", "the video")
        return decode_video(data, num_frames=num_frames, fps=fps, budget=self.config.video_budget)

    # -- URL dispatch ---------------------------------------------------------------------------

    def _fetch_bytes(self, url: str, modality: Modality) -> bytes:
        if not isinstance(url, str):
            raise _fetch_error(modality, f"a media URL must be a string, got {type(url).__name__}")
        url = url.strip()
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return self._read_data_url(url, modality)
        if scheme in ("http", "https"):
            return self._read_http_url(url, modality)
        if scheme == "file":
            return self._read_file_url(url, modality)
        raise _fetch_error(
            modality, f"unsupported URL {_describe(url)!r}: use data:, http(s):// or file://"
        )

    def _check_size(self, num_bytes: int, modality: Modality, what: str) -> None:
        cap = getattr(self.config, f"{modality}_max_bytes")
        if num_bytes > cap:
            raise _fetch_error(
                modality,
                f"{what} is too large (more than the {modality} limit of {cap} bytes; "
                f"{self.config.describe(f'{modality}_max_bytes')})",
            )

    def _read_data_url(self, url: str, modality: Modality) -> bytes:
        header, sep, payload = url[len("data:") :].partition(",")
        if not sep:
            raise _fetch_error(modality, "malformed data URL: no ',' before the data")
        params = [p.strip().lower() for p in header.split(";")]
        if params[-1] != "base64":
            raise _fetch_error(
                modality, "only base64 data URLs are supported (data:<type>;base64,<data>)"
            )
        media_type = params[0] if len(params) > 1 else ""
        if media_type.split("/", 1)[0] != modality or "/" not in media_type:
            raise MultiModalInputError(
                f"data URL media type {media_type or '(none)'!r} is not {modality}/*",
                stage="decode",
                modality=modality,
            )
        payload = "".join(payload.split())  # base64 in URLs may be wrapped
        self._check_size(len(payload) * 3 // 4, modality, "the data URL")
        try:
            return base64.b64decode(payload + "=" * (-len(payload) % 4), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise MultiModalInputError(
                f"invalid base64 in data URL: {exc}", stage="decode", modality=modality
            ) from exc

    def _read_file_url(self, url: str, modality: Modality) -> bytes:
        if self._local_root is None:
            raise _fetch_error(
                modality,
                "file:// URLs are disabled: the server has no "
                "allowed_local_media_path (--allowed-local-media-path)",
            )
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise _fetch_error(modality, f"file:// URL names a host ({parts.netloc!r})")
        try:
            # NOTE: resolve (following symlinks and '..') before the containment check.
            path = Path(unquote(parts.path)).resolve()
        except (OSError, ValueError) as exc:  # e.g. an embedded NUL byte
            raise _fetch_error(modality, f"invalid file path in {_describe(url)!r}") from exc
        if not path.is_relative_to(self._local_root):
            raise _fetch_error(
                modality, f"{_describe(url)!r} is outside the allowed local media directory"
            )
        if not path.is_file():
            raise _fetch_error(modality, f"no such file: {_describe(url)!r}")
        try:
            with path.open("rb") as file:  # read at most cap + 1: the file may grow meanwhile
                data = file.read(getattr(self.config, f"{modality}_max_bytes") + 1)
        except OSError as exc:
            raise _fetch_error(modality, f"cannot read {_describe(url)!r}: {exc}") from exc
        self._check_size(len(data), modality, _describe(url))
        return data

    # -- http(s) --------------------------------------------------------------------------------

    def _read_http_url(self, url: str, modality: Modality) -> bytes:
        timeout = getattr(self.config, f"{modality}_timeout_s")
        deadline = _Deadline(timeout, modality, _describe(url))
        try:
            target = httpx.URL(url)
        except httpx.InvalidURL as exc:
            raise _fetch_error(modality, f"invalid URL {_describe(url)!r}: {exc}") from exc
        with httpx.Client(verify=_ssl_context(), trust_env=False, follow_redirects=False) as client:
            for _ in range(_MAX_REDIRECTS + 1):
                addresses = self._vet_http_url(target, modality, deadline)
                result = self._get_or_redirect(client, target, addresses, modality, deadline)
                if isinstance(result, bytes):
                    return result
                target = result
        raise _fetch_error(
            modality, f"more than {_MAX_REDIRECTS} redirects fetching {_describe(url)!r}"
        )

    def _vet_http_url(self, url: httpx.URL, modality: Modality, deadline: _Deadline) -> list[str]:
        """Check scheme, host allow-list and resolved addresses; return the addresses to use."""
        if url.scheme not in ("http", "https"):
            raise _fetch_error(
                modality,
                f"refusing a redirect to {_describe(str(url))!r}: only http(s) may be followed",
            )
        host = _normalize_host(url.raw_host.decode("ascii"))  # IDNA-encoded, as sent
        if not host:
            raise _fetch_error(modality, f"URL {_describe(str(url))!r} has no host")
        if self._allowed_domains and host not in self._allowed_domains:
            raise _fetch_error(modality, f"host {host!r} is not in the allowed media domains")
        addresses = _resolve(
            host, url.port or (443 if url.scheme == "https" else 80), modality, deadline
        )
        if not self.config.allow_private_addresses:
            for address in addresses:
                kind = _address_refusal(address)
                if kind is not None:
                    raise _fetch_error(
                        modality,
                        f"refusing to fetch from {host!r}: it resolves "
                        f"to {address}, which is {kind} (allowed only "
                        "with --allow-private-media-urls)",
                    )
        return addresses

    def _get_or_redirect(
        self,
        client: httpx.Client,
        url: httpx.URL,
        addresses: list[str],
        modality: Modality,
        deadline: _Deadline,
    ) -> bytes | httpx.URL:
        """GET ``url`` from the first vetted address that accepts a connection: the body, or the
        next hop of a redirect."""
        # Media is compressed already; identity keeps the byte cap about bytes on the wire.
        headers = {"Host": url.netloc.decode("ascii"), "Accept-Encoding": "identity"}
        # NOTE: the TLS certificate is verified against the name, not the pinned address.
        extensions = {"sni_hostname": url.raw_host.decode("ascii")} if url.scheme == "https" else {}
        error: Exception | None = None
        for address in addresses:
            try:
                with client.stream(
                    "GET",
                    url.copy_with(host=address),
                    headers=headers,
                    extensions=extensions,
                    timeout=httpx.Timeout(deadline.remaining()),
                ) as response:
                    if response.status_code in _REDIRECT_STATUSES:
                        location = response.headers.get("location")
                        if not location:
                            raise _fetch_error(
                                modality,
                                f"HTTP {response.status_code} redirect without a Location header",
                            )
                        return url.join(location)
                    if response.status_code >= 400:
                        raise _fetch_error(
                            modality,
                            f"HTTP {response.status_code} fetching {_describe(str(url))!r}",
                        )
                    return self._read_body(response, modality, deadline)
            except httpx.ConnectError as exc:
                error = exc  # try the next address of the host
            except httpx.TimeoutException as exc:
                raise deadline.expired() from exc
            except (httpx.HTTPError, httpx.InvalidURL) as exc:  # incl. a bad Location
                raise _fetch_error(
                    modality, f"fetching {_describe(str(url))!r} failed: {exc!r}"
                ) from exc
        raise _fetch_error(modality, f"cannot connect to {url.host!r}: {error}") from error

    def _read_body(
        self, response: httpx.Response, modality: Modality, deadline: _Deadline
    ) -> bytes:
        declared = response.headers.get("content-length", "")
        if declared.isdigit():
            self._check_size(int(declared), modality, "the response")
        body = bytearray()
        # NOTE: no chunk_size: httpx would buffer up to it, hiding a slow drip from the deadline.
        for chunk in response.iter_bytes():  # decompressed bytes count
            body += chunk
            self._check_size(len(body), modality, "the response")
            deadline.remaining()
        return bytes(body)


# -- helpers ------------------------------------------------------------------------------------


class _Deadline:
    """One time budget for a whole fetch; every network wait gets what is left of it."""

    def __init__(self, timeout_s: float, modality: Modality, what: str) -> None:
        self._timeout_s = timeout_s
        self._end = time.monotonic() + timeout_s
        self._modality: Modality = modality
        self._what = what

    def remaining(self) -> float:
        left = self._end - time.monotonic()
        if left <= 0:
            raise self.expired()
        return left

    def expired(self) -> MultiModalInputError:
        return _fetch_error(
            self._modality, f"timed out after {self._timeout_s:g}s fetching {self._what!r}"
        )


def _fetch_error(modality: Modality, message: str) -> MultiModalInputError:
    return MultiModalInputError(message, stage="fetch", modality=modality)


def _describe(url: str) -> str:
    """A URL short enough for an error message (data URLs lose their payload)."""
    if url[:5].lower() == "data:":
        return url.partition(",")[0][:40] + ",..."
    return url if len(url) <= 200 else url[:200] + "..."


def _normalize_host(host: str) -> str:
    return host.strip().lower().rstrip(".")


def _address_refusal(address: str) -> str | None:
    """Why an address may not be fetched from by default ("loopback", ...), or None if public."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 scope id
    for candidate in (*_embedded_ipv4(ip), ip):  # the embedded IPv4 names the reason best
        for attribute in (
            "loopback",
            "unspecified",
            "link_local",
            "multicast",
            "private",
            "reserved",
        ):
            if getattr(candidate, f"is_{attribute}"):
                return attribute.replace("_", "-")
        if not candidate.is_global:
            return "non-global"
    return None


_NAT64_PREFIXES = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))


def _embedded_ipv4(
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address,
) -> list[ipaddress.IPv4Address]:
    """IPv4 addresses an IPv6 address routes to: mapped (::ffff:a.b.c.d), 6to4 (2002::/16),
    Teredo (2001::/32, its client and server) and NAT64 (64:ff9b::/96, 64:ff9b:1::/48)."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return []
    found = [ip.ipv4_mapped, ip.sixtofour, *(ip.teredo or ())]
    if any(ip in prefix for prefix in _NAT64_PREFIXES):
        found.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return [address for address in found if address is not None]


def _resolve(host: str, port: int, modality: Modality, deadline: _Deadline) -> list[str]:
    """The host's addresses (deduplicated, resolver order), within the fetch deadline."""
    lookup = _dns_pool().submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
    try:
        infos = lookup.result(timeout=deadline.remaining())
    except FutureTimeout as exc:
        raise deadline.expired() from exc
    except (OSError, UnicodeError) as exc:
        raise _fetch_error(modality, f"cannot resolve host {host!r}: {exc}") from exc
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


@functools.cache
def _dns_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(_NUM_DNS_THREADS, thread_name_prefix="omniserve-dns")


@functools.cache
def _loader_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(envs.media_loading_threads(), thread_name_prefix="omniserve-media")


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    return httpx.create_ssl_context()


async def _off_loop(fn: Callable[[str], T], url: str) -> T:
    """Run a blocking fetch+decode on the loader pool; its own deadline bounds the wait."""
    return await asyncio.get_running_loop().run_in_executor(_loader_pool(), fn, url)
