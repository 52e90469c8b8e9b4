"""MediaConnector: data/http/file URLs, fetch limits and address policy, decoding of each modality.

Offline: media is generated here (PIL, soundfile, PyAV) and served from a loopback http.server.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import io
import socket
import ssl
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import av
import numpy as np
import pytest
import soundfile
from PIL import Image

from omniserve.multimodal import media, media_io
from omniserve.multimodal.errors import MultiModalInputError
from omniserve.multimodal.media import MediaConfig, MediaConnector, VideoItem

Route = Callable[[BaseHTTPRequestHandler], None]
LOOPBACK = MediaConfig(allow_private_addresses=True)

# ------------------------------------------------------------------------------- generated media


def _png(width: int = 40, height: int = 30, mode: str = "RGB", seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, len(mode)), np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, mode).save(buf, format="PNG")
    return buf.getvalue()


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims huge dimensions but carries (almost) no data: a decompression bomb."""

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    chunks = [(b"IHDR", header), (b"IDAT", zlib.compress(b"")), (b"IEND", b"")]
    return b"\x89PNG\r\n\x1a\n" + b"".join(
        struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        for kind, data in chunks
    )


def _tone(seconds: float, rate: int, hz: float = 440.0) -> np.ndarray:
    return (0.5 * np.sin(2 * np.pi * hz * np.arange(int(seconds * rate)) / rate)).astype(np.float32)


def _peak_hz(waveform: np.ndarray, rate: int) -> float:
    return float(np.argmax(np.abs(np.fft.rfft(waveform))) * rate / len(waveform))


def _sf_bytes(samples: np.ndarray, rate: int, fmt: str, subtype: str | None = None) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def _mux_audio(
    container: av.container.OutputContainer, stream: av.AudioStream, waveform: np.ndarray
) -> None:
    for offset in range(0, len(waveform), 1024):
        chunk = waveform[None, offset : offset + 1024]  # [1, n]
        frame = av.AudioFrame.from_ndarray(chunk, format="flt", layout="mono")
        frame.sample_rate, frame.pts = stream.rate, offset
        container.mux(stream.encode(frame))
    container.mux(stream.encode())


def _encode_audio(fmt: str, codec: str, waveform: np.ndarray, rate: int) -> bytes:
    """A mono clip encoded with PyAV (formats soundfile cannot write: m4a, mp3)."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as container:
        _mux_audio(container, container.add_stream(codec, rate=rate, layout="mono"), waveform)
    return buf.getvalue()


def _video(num_frames: int = 30, fmt: str = "mp4", audio_rate: int | None = 16000) -> bytes:
    """64x48 at 10 fps; frame i is a flat gray of level 8 * i, so a frame tells its index."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as container:
        video = container.add_stream("mpeg4", rate=10)
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        if audio_rate is not None:  # NOTE: every stream must exist before the first mux
            audio = container.add_stream("aac", rate=audio_rate, layout="mono")
        for i in range(num_frames):
            pixels = np.full((48, 64, 3), 8 * i % 256, np.uint8)
            container.mux(video.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(video.encode())
        if audio_rate is not None:
            _mux_audio(container, audio, _tone(num_frames / 10, audio_rate))
    return buf.getvalue()


@pytest.fixture(scope="module")
def mp4() -> bytes:
    return _video()


def _data_url(media_type: str, data: bytes) -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


@contextlib.contextmanager
def _raises(stage: str, modality: str, match: str) -> Iterator[None]:
    """Expect a MultiModalInputError at ``stage`` for ``modality`` whose message matches."""
    with pytest.raises(MultiModalInputError, match=match) as info:
        yield
    assert (info.value.stage, info.value.modality) == (stage, modality)


# ---------------------------------------------------------------------------------- http server


class _Server(ThreadingHTTPServer):
    block_on_close = False  # handlers that sleep must not hold up teardown
    routes: dict[str, Route]
    hits: dict[str, int]


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        path = self.path.split("?", 1)[0]
        self.server.hits[path] = self.server.hits.get(path, 0) + 1
        route = self.server.routes.get(path)
        if route is None:
            self.send_error(404)
        else:
            route(self)

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def _serving(tls: ssl.SSLContext | None = None) -> Iterator[_Server]:
    httpd = _Server(("127.0.0.1", 0), _Handler)
    httpd.routes, httpd.hits = {}, {}
    if tls is not None:
        httpd.socket = tls.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
def server() -> Iterator[_Server]:
    with _serving() as httpd:
        yield httpd


def _url(server: _Server, path: str, host: str = "127.0.0.1") -> str:
    return f"http://{host}:{server.server_address[1]}{path}"


def _static(body: bytes, status: int = 200, location: str | None = None) -> Route:
    def route(h: BaseHTTPRequestHandler) -> None:
        h.send_response(status)
        if location is not None:
            h.send_header("Location", location)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        try:
            h.wfile.write(body)
        except OSError:
            pass  # the client gave up (timeout and byte-cap tests)

    return route


def _redirect(location: str) -> Route:
    return _static(b"", status=302, location=location)


def _sleepy(seconds: float, body: bytes) -> Route:
    def route(h: BaseHTTPRequestHandler) -> None:
        time.sleep(seconds)
        _static(body)(h)

    return route


def _streaming(
    chunk: bytes, count: int, pause_s: float, sent: list[int], done: threading.Event
) -> Route:
    """No Content-Length (body ends at close): ``count`` chunks, recording bytes written."""

    def route(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.end_headers()
        try:
            for _ in range(count):
                h.wfile.write(chunk)
                h.wfile.flush()
                sent[0] += len(chunk)
                time.sleep(pause_s)
        except OSError:
            pass  # the client hung up, as it should
        finally:
            done.set()

    return route


# ---------------------------------------------------------------------------------- data: URLs


def test_data_url_image_rgb_and_alpha_on_white() -> None:
    connector = MediaConnector()
    png = _png(40, 30)
    image = connector.fetch_image(_data_url("image/png", png))
    assert image.mode == "RGB" and image.size == (40, 30)
    assert np.array_equal(np.asarray(image), np.asarray(Image.open(io.BytesIO(png))))

    transparent = io.BytesIO()
    Image.new("RGBA", (4, 4), (10, 20, 30, 0)).save(transparent, format="PNG")
    image = connector.fetch_image(_data_url("image/png", transparent.getvalue()))
    assert np.all(np.asarray(image) == 255)  # HF's convert_to_rgb composites on white


def test_data_url_audio_stereo_to_mono_and_video(mp4: bytes) -> None:
    left = _tone(0.5, 8000)
    stereo = np.stack([left, 0.5 * left], axis=1)  # [n, 2]
    waveform, rate = MediaConnector().fetch_audio(
        _data_url("audio/wav", _sf_bytes(stereo, 8000, "WAV", "FLOAT"))
    )
    assert rate == 8000 and waveform.dtype == np.float32 and waveform.shape == (4000,)
    np.testing.assert_allclose(waveform, 0.75 * left, atol=1e-6)
    item = MediaConnector().fetch_video(_data_url("video/mp4", mp4), num_frames=3)
    assert isinstance(item, VideoItem) and item.frames.shape == (3, 48, 64, 3)
    assert item.frames.dtype == np.uint8 and item.frame_indices == [0, 14, 29]


def test_data_url_rejections() -> None:
    connector = MediaConnector()
    png = _png()
    with _raises("decode", "image", r"'text/plain' is not image/\*"):
        connector.fetch_image(_data_url("text/plain", png))
    with _raises("decode", "audio", r"'image/png' is not audio/\*"):
        connector.fetch_audio(_data_url("image/png", png))
    with _raises("decode", "image", "'\\(none\\)' is not image"):
        connector.fetch_image("data:;base64," + base64.b64encode(png).decode())
    with _raises("fetch", "image", "only base64"):
        connector.fetch_image("data:image/png,rawbytes")
    with _raises("decode", "image", "invalid base64"):
        connector.fetch_image("data:image/png;base64,@@not-base64@@")
    with _raises("fetch", "image", "too large"):
        MediaConnector(MediaConfig(image_max_bytes=100)).fetch_image(_data_url("image/png", png))


def test_unsupported_schemes() -> None:
    for url in ("ftp://example.com/a.png", "/etc/passwd", "gopher://x"):
        with _raises("fetch", "image", "unsupported URL"):
            MediaConnector().fetch_image(url)


# ---------------------------------------------------------------------------------- decoding


def test_image_decode_errors_and_bomb_guard() -> None:
    connector = MediaConnector()
    with _raises("decode", "image", "cannot decode image"):
        connector.load_image_bytes(b"definitely not an image" * 10)
    with _raises("decode", "image", "cannot decode image"):  # EPS would run Ghostscript
        connector.load_image_bytes(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n")
    noisy = _png(200, 200)
    with _raises("decode", "image", "cannot decode image"):
        connector.load_image_bytes(noisy[: len(noisy) // 2])  # truncated
    with _raises("decode", "image", "over the limit of 10000"):
        MediaConnector(MediaConfig(max_image_pixels=10_000)).load_image_bytes(noisy)
    # Header-only bombs: refused before any pixel is decoded (ours, then PIL's own hard limit).
    with _raises("decode", "image", "8000x8000 = 64000000 pixels, over the limit"):
        connector.load_image_bytes(_png_header_only(8000, 8000))
    with _raises("decode", "image", "decompression-bomb guard"):
        connector.load_image_bytes(_png_header_only(20000, 20000))


def test_audio_formats_soundfile_and_pyav() -> None:
    connector = MediaConnector()
    tone = _tone(1.0, 16000)
    waveform, rate = connector.load_audio_bytes(_sf_bytes(tone, 16000, "FLAC", "PCM_16"))
    assert rate == 16000
    np.testing.assert_allclose(waveform, tone, atol=1e-4)
    waveform, rate = connector.load_audio_bytes(_sf_bytes(tone, 16000, "OGG", "VORBIS"))
    assert rate == 16000 and abs(len(waveform) - 16000) < 100 and _peak_hz(waveform, rate) == 440
    # m4a (AAC) is not libsndfile's: the PyAV fallback decodes it.
    m4a = _encode_audio("ipod", "aac", tone, 16000)
    with pytest.raises(soundfile.LibsndfileError):
        soundfile.read(io.BytesIO(m4a))
    waveform, rate = connector.load_audio_bytes(m4a)
    assert rate == 16000 and waveform.dtype == np.float32 and waveform.ndim == 1
    assert abs(len(waveform) - 16000) <= 2048 and abs(_peak_hz(waveform, rate) - 440) < 2
    with _raises("decode", "audio", "cannot decode audio"):
        connector.load_audio_bytes(b"RIFF garbage" * 50)
    # Float formats can carry NaN and infinity: refused, not passed on to the encoder.
    for bad in (np.nan, np.inf):
        with _raises("decode", "audio", "samples that are NaN or infinite"):
            samples = tone.copy()
            samples[100] = bad
            connector.load_audio_bytes(_sf_bytes(samples, 16000, "WAV", "FLOAT"))


def test_audio_seconds_from_the_header_alone() -> None:
    """What speech to text reads to skip decoding a file within the model's window: libsndfile's
    header, else PyAV's container (m4a); None for what neither opens."""
    tone = _tone(2.5, 16000)
    assert media_io.audio_seconds(_sf_bytes(tone, 16000, "WAV", "PCM_16")) == pytest.approx(2.5)
    assert media_io.audio_seconds(_sf_bytes(tone, 16000, "FLAC", "PCM_16")) == pytest.approx(2.5)
    m4a = _encode_audio("ipod", "aac", tone, 16000)
    assert media_io.audio_seconds(m4a) == pytest.approx(2.5, abs=0.1)
    assert media_io.audio_seconds(b"RIFF garbage" * 50) is None


@pytest.mark.skipif("libmp3lame" not in av.codecs_available, reason="no mp3 encoder")
def test_audio_mp3() -> None:
    mp3 = _encode_audio("mp3", "libmp3lame", _tone(1.0, 22050), 22050)
    waveform, rate = MediaConnector().fetch_audio(_data_url("audio/mpeg", mp3))
    assert rate == 22050 and abs(len(waveform) - 22050) <= 2 * 1152
    assert abs(_peak_hz(waveform, rate) - 440) < 2


def test_video_sampling_by_num_frames_and_fps(mp4: bytes) -> None:
    connector = MediaConnector()
    item = connector.load_video_bytes(mp4, num_frames=4)
    assert item.frame_indices == [0, 10, 19, 29] and item.frames.shape == (4, 48, 64, 3)
    assert item.source_fps == 10 and item.num_source_frames == 30
    assert item.fps == pytest.approx(10 * 4 / 30)
    levels = item.frames.reshape(4, -1).mean(axis=1)
    np.testing.assert_allclose(levels, [8 * i for i in item.frame_indices], atol=6)

    item = connector.load_video_bytes(mp4, fps=2)  # 3 s of video at 2 fps
    assert item.frame_indices == [0, 6, 12, 17, 23, 29] and item.fps == pytest.approx(2)
    assert connector.load_video_bytes(mp4, fps=2, num_frames=3).frame_indices == [0, 14, 29]
    five = MediaConnector(MediaConfig(video_num_frames=5))
    assert len(five.load_video_bytes(mp4).frame_indices) == 5  # the config default
    assert len(five.load_video_bytes(mp4, fps=3).frame_indices) == 5  # which also caps fps
    assert connector.load_video_bytes(mp4, num_frames=100).frame_indices == list(range(30))
    with _raises("process", "video", "num_frames must be"):
        connector.load_video_bytes(mp4, num_frames=0)
    with _raises("process", "video", "fps must be"):
        connector.load_video_bytes(mp4, fps=-1.0)


def test_video_audio_track(mp4: bytes) -> None:
    item = MediaConnector().load_video_bytes(mp4, num_frames=2)
    assert item.audio is not None
    waveform, rate = item.audio
    assert rate == 16000 and waveform.dtype == np.float32 and waveform.ndim == 1
    assert abs(len(waveform) - 3 * 16000) <= 2048 and abs(_peak_hz(waveform, rate) - 440) < 2


def test_video_without_frame_count_and_without_audio(monkeypatch: pytest.MonkeyPatch) -> None:
    mkv = _video(num_frames=25, fmt="matroska", audio_rate=None)
    item = MediaConnector().load_video_bytes(mkv, num_frames=5)
    assert item.audio is None and item.frame_indices == [0, 6, 12, 18, 24]
    # No duration either: the first pass only counts frames, the second samples them.
    monkeypatch.setattr(media_io, "_stream_seconds", lambda *args: None)
    again = MediaConnector().load_video_bytes(mkv, num_frames=5)
    assert again.frame_indices == item.frame_indices
    assert np.array_equal(again.frames, item.frames)


def test_video_decode_errors() -> None:
    with _raises("decode", "video", "cannot decode video"):
        MediaConnector().load_video_bytes(b"\x00\x00\x00\x18ftypmp42" + b"junk" * 100)
    with _raises("decode", "video", "over the limit of 1000 pixels per frame"):
        MediaConnector(MediaConfig(max_image_pixels=1000)).load_video_bytes(_video(3))


# ---------------------------------------------------------------------------------- http(s)


def test_http_fetch_each_modality_and_errors(server: _Server, mp4: bytes) -> None:
    png = _png(10, 12)
    server.routes.update(
        {
            "/a.png": _static(png),
            "/v.mp4": _static(mp4),
            "/a.wav": _static(_sf_bytes(_tone(0.25, 8000), 8000, "WAV")),
        }
    )
    connector = MediaConnector(LOOPBACK)
    assert connector.fetch_image(_url(server, "/a.png")).size == (10, 12)
    assert connector.fetch_image(_url(server, "/a.png", host="localhost")).size == (10, 12)
    assert connector.fetch_audio(_url(server, "/a.wav"))[0].shape == (2000,)
    assert connector.fetch_video(_url(server, "/v.mp4"), num_frames=2).frame_indices == [0, 29]
    with _raises("fetch", "image", "HTTP 404"):
        connector.fetch_image(_url(server, "/missing.png"))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    with _raises("fetch", "image", "cannot connect"):
        MediaConnector(LOOPBACK).fetch_image(f"http://127.0.0.1:{port}/x.png")


def test_http_byte_cap(server: _Server) -> None:
    connector = MediaConnector(MediaConfig(allow_private_addresses=True, image_max_bytes=1000))
    server.routes["/big.png"] = _static(b"x" * 5000)  # declared Content-Length over the cap
    with _raises("fetch", "image", "too large"):
        connector.fetch_image(_url(server, "/big.png"))
    sent, done = [0], threading.Event()
    chunk, count = b"y" * 65536, 512  # 32 MiB offered, no Content-Length
    server.routes["/endless.png"] = _streaming(chunk, count, 0.0, sent, done)
    with _raises("fetch", "image", "too large"):
        connector.fetch_image(_url(server, "/endless.png"))
    assert done.wait(10)
    assert sent[0] < len(chunk) * count // 4  # the client stopped reading past the cap


def test_http_timeouts(server: _Server) -> None:
    connector = MediaConnector(MediaConfig(allow_private_addresses=True, image_timeout_s=0.4))
    server.routes["/slow.png"] = _sleepy(2.0, _png())
    start = time.monotonic()
    with _raises("fetch", "image", "timed out after 0.4s"):
        connector.fetch_image(_url(server, "/slow.png"))
    assert time.monotonic() - start < 1.5
    # A server that keeps trickling bytes is cut off by the whole-fetch deadline too.
    server.routes["/drip.png"] = _streaming(b"z", 200, 0.05, [0], threading.Event())
    start = time.monotonic()
    with _raises("fetch", "image", "timed out"):
        connector.fetch_image(_url(server, "/drip.png"))
    assert time.monotonic() - start < 1.5


def test_private_addresses_refused_by_default(server: _Server) -> None:
    server.routes["/p.png"] = _static(_png())
    connector = MediaConnector()
    with _raises("fetch", "image", "127.0.0.1, which is loopback"):
        connector.fetch_image(_url(server, "/p.png"))
    with _raises("fetch", "image", "which is loopback"):
        connector.fetch_image(_url(server, "/p.png", host="localhost"))
    with _raises("fetch", "image", "which is loopback"):  # IPv4-mapped IPv6
        connector.fetch_image(_url(server, "/p.png", host="[::ffff:127.0.0.1]"))
    # IPv4 embedded in IPv6: 6to4, NAT64 and Teredo (client 127.0.1.1, stored inverted).
    for host in ("[2002:7f00:1::]", "[64:ff9b::7f00:1]", "[2001:0:4136:e378:8000:63bf:80ff:fefe]"):
        with _raises("fetch", "image", "which is loopback"):
            connector.fetch_image(_url(server, "/p.png", host=host))
    for host, kind in (
        ("169.254.169.254", "link-local"),
        ("10.1.2.3", "private"),
        ("0.0.0.0", "unspecified"),
        ("224.0.0.1", "multicast"),
    ):
        with _raises("fetch", "image", f"which is {kind}"):
            connector.fetch_image(f"http://{host}/latest/meta-data")
    assert server.hits.get("/p.png", 0) == 0  # refused before connecting
    assert MediaConnector(LOOPBACK).fetch_image(_url(server, "/p.png")).size == (40, 30)


def test_redirects_are_rechecked(server: _Server, monkeypatch: pytest.MonkeyPatch) -> None:
    server.routes.update(
        {
            "/r.png": _static(_png(7, 7)),
            "/hop1": _redirect("/hop2"),
            "/hop2": _redirect(_url(server, "/r.png")),
            "/loop": _redirect("/loop"),
            "/to-metadata": _redirect("http://169.254.169.254/latest/meta-data"),
            "/to-file": _redirect("file:///etc/passwd"),
        }
    )
    assert MediaConnector(LOOPBACK).fetch_image(_url(server, "/hop1")).size == (7, 7)
    with _raises("fetch", "image", "more than 5 redirects"):
        MediaConnector(LOOPBACK).fetch_image(_url(server, "/loop"))
    with _raises("fetch", "image", "only http\\(s\\) may be followed"):
        MediaConnector(LOOPBACK).fetch_image(_url(server, "/to-file"))
    # Treat this test server as a public host; the private hop must still be refused.
    real_refusal = media._address_refusal
    monkeypatch.setattr(
        media,
        "_address_refusal",
        lambda address: None if address == "127.0.0.1" else real_refusal(address),
    )
    with _raises("fetch", "image", "169.254.169.254, which is link-local"):
        MediaConnector().fetch_image(_url(server, "/to-metadata"))


def test_domain_allow_list(server: _Server) -> None:
    server.routes["/d.png"] = _static(_png(5, 6))
    connector = MediaConnector(
        MediaConfig(allow_private_addresses=True, allowed_media_domains=("LOCALHOST",))
    )
    assert connector.fetch_image(_url(server, "/d.png", host="localhost")).size == (5, 6)
    with _raises("fetch", "image", "'127.0.0.1' is not in the allowed media domains"):
        connector.fetch_image(_url(server, "/d.png"))
    server.routes["/away"] = _redirect(_url(server, "/d.png"))  # to a host not on the list
    with _raises("fetch", "image", "not in the allowed media domains"):
        connector.fetch_image(_url(server, "/away", host="localhost"))


def _self_signed_localhost() -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) for DNS name "localhost" only."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def test_https_pinned_address_keeps_sni_and_verification(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert_pem, key_pem = _self_signed_localhost()
    (tmp_path / "cert.pem").write_bytes(cert_pem)
    (tmp_path / "key.pem").write_bytes(key_pem)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    monkeypatch.setattr(
        media, "_ssl_context", lambda: ssl.create_default_context(cadata=cert_pem.decode())
    )
    with _serving(tls) as httpd:
        httpd.routes["/s.png"] = _static(_png(6, 5))
        port = httpd.server_address[1]
        # Connects to the vetted 127.0.0.1 but verifies the certificate for "localhost".
        image = MediaConnector(LOOPBACK).fetch_image(f"https://localhost:{port}/s.png")
        assert image.size == (6, 5)
        with _raises("fetch", "image", "CERTIFICATE_VERIFY_FAILED"):
            MediaConnector(LOOPBACK).fetch_image(f"https://127.0.0.1:{port}/s.png")


# ---------------------------------------------------------------------------------- file://


def test_file_urls(tmp_path: Path) -> None:
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "in.png").write_bytes(_png(9, 8))
    (tmp_path / "secret.png").write_bytes(_png(3, 3))
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    connector = MediaConnector(MediaConfig(allowed_local_media_path=str(allowed)))
    assert connector.fetch_image((allowed / "in.png").as_uri()).size == (9, 8)
    assert connector.fetch_image(f"file://localhost{allowed}/in.png").size == (9, 8)
    for url in (
        (tmp_path / "secret.png").as_uri(),
        f"file://{allowed}/../secret.png",
        f"file://{allowed}/%2E%2E/secret.png",
        (allowed / "link.png").as_uri(),
    ):
        with _raises("fetch", "image", "outside the allowed local media directory"):
            connector.fetch_image(url)
    with _raises("fetch", "image", "no such file"):
        connector.fetch_image((allowed / "nope.png").as_uri())
    with _raises("fetch", "image", "names a host"):
        connector.fetch_image(f"file://example.com{allowed}/in.png")
    small = MediaConnector(MediaConfig(allowed_local_media_path=str(allowed), image_max_bytes=64))
    with _raises("fetch", "image", "too large"):
        small.fetch_image((allowed / "in.png").as_uri())
    with _raises("fetch", "image", "invalid file path"):
        connector.fetch_image(f"file://{allowed}/bad%00name.png")
    with _raises("fetch", "image", "file:// URLs are disabled"):
        MediaConnector().fetch_image((allowed / "in.png").as_uri())
    with pytest.raises(ValueError, match="not a directory"):
        MediaConnector(MediaConfig(allowed_local_media_path=str(tmp_path / "missing")))


# ---------------------------------------------------------------------------------- async


def test_async_variants_run_off_the_event_loop(server: _Server, mp4: bytes) -> None:
    server.routes.update(
        {
            "/slow-a.png": _sleepy(0.3, _png(11, 11)),
            "/av.mp4": _static(mp4),
            "/t.flac": _static(_sf_bytes(_tone(0.5, 8000), 8000, "FLAC")),
        }
    )
    connector = MediaConnector(LOOPBACK)

    async def main() -> tuple[int, list[object]]:
        fetches = asyncio.gather(
            connector.fetch_image_async(_url(server, "/slow-a.png")),
            connector.fetch_audio_async(_url(server, "/t.flac")),
            connector.fetch_video_async(_url(server, "/av.mp4"), fps=1.0),
        )
        ticks = 0
        while not fetches.done():
            await asyncio.sleep(0.01)
            ticks += 1
        return ticks, await fetches

    ticks, (image, (waveform, rate), video) = asyncio.run(main())
    assert ticks >= 10  # the loop kept running while the image's server slept
    assert image.size == (11, 11) and rate == 8000 and waveform.shape == (4000,)
    assert video.frame_indices == [0, 14, 29] and video.audio is not None
    with _raises("fetch", "image", "HTTP 404"):
        asyncio.run(connector.fetch_image_async(_url(server, "/none.png")))


def test_audio_longer_than_the_limit_is_refused_before_resampling() -> None:
    """2 KB of WAV declared at 1 Hz is 2,000 s of audio: refused at decode, not resampled."""
    tiny_rate = _sf_bytes(np.zeros(2000, dtype=np.float32), 1, "WAV", "PCM_16")
    connector = MediaConnector()
    with _raises(
        "decode",
        "audio",
        r"lasts 2000\.0 s, over the limit of 600 s "
        r"\(--media-io-kwargs \{\"audio\": \{\"max_seconds\"",
    ):
        connector.load_audio_bytes(tiny_rate)
    short = MediaConnector(MediaConfig(max_audio_seconds=0.5))
    with _raises("decode", "audio", "over the limit of 0.5 s"):
        short.load_audio_bytes(_sf_bytes(_tone(1.0, 16000), 16000, "WAV"))
    assert connector.load_audio_bytes(_sf_bytes(_tone(1.0, 16000), 16000, "WAV"))[1] == 16000


def test_video_budgets_refuse_from_the_header_before_decoding(
    mp4: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """30 frames of 64x48 at 10 fps (3 s), with 3 s of 16 kHz audio."""

    def never(*args: object) -> None:
        raise AssertionError("decoded a video its header already put over budget")

    with monkeypatch.context() as patch:
        patch.setattr(media_io, "_decode_pass", never)
        for options, needle in [
            ({"max_frames": 29}, "30 or more frames, over the limit of 29"),
            ({"max_seconds": 2.5}, "lasts 3.0 s, over the limit of 2.5 s"),
            ({"max_total_pixels": 64 * 48 * 29}, f"{64 * 48 * 30} or more pixels, over the limit"),
        ]:
            connector = MediaConnector(MediaConfig.from_options({"video": options}))
            key = next(iter(options))
            with _raises("decode", "video", needle):
                connector.load_video_bytes(mp4)
            with pytest.raises(MultiModalInputError, match=f'"video": {{"{key}"'):
                connector.load_video_bytes(mp4)
    within = MediaConnector(
        MediaConfig.from_options(
            {"video": {"max_frames": 30, "max_seconds": 3.0, "max_total_pixels": 64 * 48 * 30}}
        )
    )
    assert len(within.load_video_bytes(mp4).frame_indices) == 30


def test_video_budgets_hold_when_the_header_says_nothing(mp4: bytes) -> None:
    """Matroska stores no frame count and the duration can be missing: the decode pass counts."""
    mkv = _video(num_frames=25, fmt="matroska", audio_rate=None)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(media_io, "_stream_seconds", lambda *args: None)
        with _raises("decode", "video", "25 or more frames, over the limit of 24"):
            MediaConnector(MediaConfig(max_video_frames=24)).load_video_bytes(mkv)
        with _raises(
            "decode",
            "video",
            r"the video's audio track lasts at least 2\.\d s, over "
            r"the limit of 2\.5 s \(--media-io-kwargs \{\"audio\"",
        ):
            MediaConnector(MediaConfig(max_audio_seconds=2.5)).load_video_bytes(mp4)
    with _raises("decode", "video", r"the video's audio track lasts 3\.0 s, over the limit"):
        MediaConnector(MediaConfig(max_audio_seconds=2.5)).load_video_bytes(mp4)


def test_audio_through_pyav_is_refused_from_its_header(mp4: bytes) -> None:
    """A format libsndfile does not read (AAC in MP4) takes the PyAV path, with the same limit."""
    with _raises("decode", "audio", r"lasts 3\.0 s, over the limit of 2 s"):
        MediaConnector(MediaConfig(max_audio_seconds=2)).load_audio_bytes(mp4)
    waveform, rate = MediaConnector().load_audio_bytes(mp4)
    assert rate == 16000 and waveform.size == pytest.approx(3 * 16000, rel=0.05)


def test_media_io_kwargs_and_vllm_timeout_env(monkeypatch: pytest.MonkeyPatch) -> None:
    config = MediaConfig.from_options(
        {"image": {"max_pixels": 1000, "max_bytes": 10}, "video": {"num_frames": 8}}
    )
    assert (config.max_image_pixels, config.image_max_bytes, config.video_num_frames) == (
        1000,
        10,
        8,
    )
    for options, needle in [
        ({"picture": {}}, "'picture' is not a modality; use image, audio, video"),
        ({"video": {"fps": 2}}, "video.fps is not an option; video takes num_frames"),
        ({"video": 16}, "'video' must map to an object"),
        (
            {"audio": {"max_seconds": -1}},
            r'--media-io-kwargs \{"audio": \{"max_seconds": \.\.\.\}\} must be > 0',
        ),
        (
            {"video": {"num_frames": 2.5}},
            r'\{"video": \{"num_frames": \.\.\.\}\} must be a '
            "number",
        ),
        (
            {"image": {"max_pixels": True}},
            r'\{"image": \{"max_pixels": \.\.\.\}\} must be a '
            "number",
        ),
    ]:
        with pytest.raises(ValueError, match=needle):
            MediaConfig.from_options(options)
    monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "2.5")
    monkeypatch.setenv("VLLM_VIDEO_FETCH_TIMEOUT", "90")
    config = MediaConfig.from_options()
    assert (config.image_timeout_s, config.audio_timeout_s, config.video_timeout_s) == (
        2.5,
        10,
        90.0,
    )
    monkeypatch.setenv("VLLM_AUDIO_FETCH_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="VLLM_AUDIO_FETCH_TIMEOUT must be a number"):
        MediaConfig.from_options()
