"""The demo model's synthetic multimodal instruction set: media, questions and answers.

One generator serves training (`scripts/train_demo_model.py`), evaluation
(`scripts/eval_demo_model.py`) and the tests, so all three see the same distribution; a held-out
set is the same generator under another seed. Every example is a pure function of
`(seed, index)`, which makes training resumable without storing data.

Media are produced as the files a client would send (PNG, WAV, MP4 with an AAC track), so the
model is trained on what the server's decoders return for them, codec artefacts included.
Each question has one answer sentence, and a reply is correct when it equals that sentence up to
case, punctuation and spacing.
"""

from __future__ import annotations

import base64
import functools
import io
import random
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

GENERATOR_VERSION = 2
"""Bump when an example for a given (seed, index) changes; the model card records it."""

SHAPES = ("circle", "square", "triangle")
COLOURS = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220),
    "yellow": (235, 205, 30), "purple": (150, 60, 190),
}  # fmt: skip
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
POSITIONS = ("left", "right", "top", "bottom")
DIRECTIONS = ("left", "right", "up", "down")
PITCHES = {"low": (180.0, 330.0), "high": (900.0, 1600.0)}
"""Tone frequency ranges in Hz."""
LOUDNESS = {"quiet": (0.03, 0.07), "loud": (0.4, 0.7)}
"""Peak amplitude ranges."""
MAX_SHAPES = 3
MAX_BEEPS = 4
SAMPLE_RATE = 16000
VIDEO_FRAMES, VIDEO_FPS, VIDEO_SIZE = 2, 1, 128
AUDIO_SECONDS = (1.6, 2.4)

TASKS = ("image", "audio", "video", "audio_in_video", "image_audio", "text")
TASK_WEIGHTS = (4, 4, 3, 3, 2, 1)
"""Training mix: harder perception tasks get more examples; chat needs few."""


@dataclass
class Example:
    """One chat turn about zero or more media files, with the single correct answer."""

    task: str
    question: str
    answer: str
    image: bytes | None = None
    """PNG."""
    audio: bytes | None = None
    """WAV, 16 kHz mono."""
    video: bytes | None = None
    """MP4 (H.264, and an AAC track for audio-in-video)."""
    use_audio_in_video: bool = False
    facts: dict[str, Any] = field(default_factory=dict)
    """What the media show (`count`, `colour`, `beeps`, ...): training supervises the towers
    with them."""

    def messages(self) -> list[dict[str, Any]]:
        """The OpenAI chat messages that ask this example's question."""
        parts: list[dict[str, Any]] = []
        if self.image is not None:
            parts.append(
                {"type": "image_url", "image_url": {"url": _data_url("image/png", self.image)}}
            )
        if self.video is not None:
            parts.append(
                {"type": "video_url", "video_url": {"url": _data_url("video/mp4", self.video)}}
            )
        if self.audio is not None:
            parts.append(
                {
                    "type": "input_audio",
                    "input_audio": {"data": base64.b64encode(self.audio).decode(), "format": "wav"},
                }
            )
        if not parts:
            return [{"role": "user", "content": self.question}]
        return [{"role": "user", "content": [*parts, {"type": "text", "text": self.question}]}]

    def mm_processor_kwargs(self) -> dict[str, Any] | None:
        return {"use_audio_in_video": True} if self.use_audio_in_video else None

    def is_correct(self, reply: str) -> bool:
        return normalize(reply) == normalize(self.answer)


def normalize(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9 ]", " ", text.lower()).split())


def make_example(seed: int, index: int, task: str | None = None) -> Example:
    """Example `index` of the set drawn with `seed`; `task` forces its kind."""
    rng = random.Random(f"omniserve-demo-{GENERATOR_VERSION}-{seed}-{index}")
    task = task or rng.choices(TASKS, TASK_WEIGHTS)[0]
    return _MAKERS[task](rng)


def make_examples(seed: int, count: int, tasks: tuple[str, ...] = TASKS) -> list[Example]:
    """`count` examples, cycling through `tasks` so each gets an equal share."""
    return [make_example(seed, i, tasks[i % len(tasks)]) for i in range(count)]


# --- sentences ----------------------------------------------------------------------------------


def _count_phrase(count: int, noun: str) -> str:
    return f"{NUMBER_WORDS[count]} {noun}{'s' if count > 1 else ''}"


def _where(position: str) -> str:
    return f"on the {position}" if position in ("left", "right") else f"at the {position}"


def _moves(direction: str) -> str:
    return f"to the {direction}" if direction in ("left", "right") else direction


def _seen(scene: dict[str, Any]) -> str:
    return _count_phrase(scene["count"], f"{scene['colour']} {scene['shape']}")


def _heard(sound: dict[str, Any]) -> str:
    return _count_phrase(sound["beeps"], f"{sound['loudness']} {sound['pitch']} beep")


def _image_qa(rng: random.Random, scene: dict[str, Any]) -> tuple[str, str]:
    count, shape, colour = scene["count"], scene["shape"], scene["colour"]
    noun = shape if count == 1 else f"{shape}s"
    choices = [
        (
            rng.choice(("What do you see?", "Describe the image.", "What is in the picture?")),
            f"I see {_seen(scene)}.",
        ),
        (
            rng.choice(("What colour is the shape?", "What color are the shapes?")),
            f"The {noun} {'is' if count == 1 else 'are'} {colour}.",
        ),
        (
            rng.choice(("How many shapes are there?", "Count the shapes.")),
            f"There {'is' if count == 1 else 'are'} {_count_phrase(count, shape)}.",
        ),
        (
            rng.choice(("What shape is it?", "Which shape do you see?")),
            f"{'It is a' if count == 1 else 'They are'} {noun}.",
        ),
    ]
    if count == 1:
        choices.append(
            (
                rng.choice(("Where is the shape?", "Where is it in the image?")),
                f"The {colour} {shape} is {_where(scene['position'])}.",
            )
        )
    return rng.choice(choices)


def _audio_qa(rng: random.Random, sound: dict[str, Any]) -> tuple[str, str]:
    beeps = sound["beeps"]
    return rng.choice(
        [
            (rng.choice(("What do you hear?", "Describe the sound.")), f"I hear {_heard(sound)}."),
            (
                rng.choice(("How many beeps are there?", "Count the beeps.")),
                f"There {'is' if beeps == 1 else 'are'} {_count_phrase(beeps, 'beep')}.",
            ),
            ("Is the sound high or low?", f"The sound is {sound['pitch']}."),
            ("Is the sound loud or quiet?", f"The sound is {sound['loudness']}."),
        ]
    )


def _video_qa(rng: random.Random, motion: dict[str, Any]) -> tuple[str, str]:
    return rng.choice(
        [
            (
                rng.choice(("What happens in the video?", "Describe the video.")),
                f"A {motion['colour']} {motion['shape']} moves {_moves(motion['direction'])}.",
            ),
            ("Which way does the shape move?", f"It moves {_moves(motion['direction'])}."),
            ("What colour is the moving shape?", f"It is {motion['colour']}."),
            ("What shape moves in the video?", f"A {motion['shape']} moves."),
        ]
    )


# --- tasks --------------------------------------------------------------------------------------


def _single_media_example(task: str, rng: random.Random) -> Example:
    content_of, qa, media, render = _SINGLE_MEDIA[task]
    content = content_of(rng)
    question, answer = qa(rng, content)
    return Example(task, question, answer, **{media: render(rng, content)}, facts=content)


def _audio_in_video_example(rng: random.Random) -> Example:
    motion, sound = _motion(rng), _sound(rng, seconds=VIDEO_FRAMES / VIDEO_FPS)
    both = (
        "What do you see and hear?",
        f"A {motion['colour']} {motion['shape']} moves {_moves(motion['direction'])}, "
        f"and I hear {_heard(sound)}.",
    )
    question, answer = rng.choice([both, both, _video_qa(rng, motion), _audio_qa(rng, sound)])
    return Example(
        "audio_in_video",
        question,
        answer,
        video=_mp4(_draw_motion(rng, motion), _synth(rng, sound)),
        use_audio_in_video=True,
        facts={**motion, **sound},
    )


def _image_audio_example(rng: random.Random) -> Example:
    scene, sound = _scene(rng), _sound(rng)
    both = ("What do you see and hear?", f"I see {_seen(scene)}, and I hear {_heard(sound)}.")
    question, answer = rng.choice([both, both, _image_qa(rng, scene), _audio_qa(rng, sound)])
    return Example(
        "image_audio",
        question,
        answer,
        image=_png(_draw_scene(rng, scene)),
        audio=_wav(_synth(rng, sound)),
        facts={**scene, **sound},
    )


_GREETING = (
    "Hello! I am omniserve's tiny demo model. Show me an image, a sound or a video "
    "and ask me about it."
)
_CHAT = (
    (("Hello!", "Hi", "Hi there!", "Hey"), _GREETING),
    (("Who are you?", "What are you?"), _GREETING),
    (
        ("What can you do?", "How can you help me?"),
        "I can tell you about shapes and colours in images, beeps in sounds, and moving shapes "
        "in videos.",
    ),
    (("Thank you!", "Thanks"), "You are welcome!"),
)


def _text_example(rng: random.Random) -> Example:
    if rng.random() < 0.5:
        a, b = rng.randrange(5), rng.randrange(5)
        return Example(
            "text",
            f"What is {NUMBER_WORDS[a]} plus {NUMBER_WORDS[b]}?",
            f"{NUMBER_WORDS[a].capitalize()} plus {NUMBER_WORDS[b]} is {NUMBER_WORDS[a + b]}.",
        )
    questions, answer = rng.choice(_CHAT)
    return Example("text", rng.choice(questions), answer)


# --- what the media show ------------------------------------------------------------------------


def _scene(rng: random.Random) -> dict[str, Any]:
    count = rng.randint(1, MAX_SHAPES)
    scene = {"count": count, "shape": rng.choice(SHAPES), "colour": rng.choice(list(COLOURS))}
    if count == 1:
        scene["position"] = rng.choice(POSITIONS)
    return scene


def _sound(rng: random.Random, seconds: float | None = None) -> dict[str, Any]:
    return {
        "beeps": rng.randint(1, MAX_BEEPS),
        "loudness": rng.choice(list(LOUDNESS)),
        "pitch": rng.choice(list(PITCHES)),
        "seconds": seconds if seconds is not None else rng.uniform(*AUDIO_SECONDS),
    }


def _motion(rng: random.Random) -> dict[str, Any]:
    return {
        "shape": rng.choice(SHAPES),
        "colour": rng.choice(list(COLOURS)),
        "direction": rng.choice(DIRECTIONS),
    }


# --- drawing and synthesis ----------------------------------------------------------------------


def _background(rng: random.Random, width: int, height: int) -> np.ndarray:
    level = rng.randint(190, 245)
    noise = np.random.default_rng(rng.getrandbits(32)).integers(-8, 9, (height, width, 3))
    return np.clip(level + noise, 0, 255).astype(np.uint8)


def _draw_shape(
    pixels: np.ndarray,
    shape: str,
    colour: str,
    cx: float,
    cy: float,
    radius: float,
    jitter: random.Random,
) -> None:
    from PIL import Image, ImageDraw

    image = Image.fromarray(pixels)
    draw = ImageDraw.Draw(image)
    rgb = tuple(int(np.clip(c + jitter.randint(-15, 15), 0, 255)) for c in COLOURS[colour])
    box = (cx - radius, cy - radius, cx + radius, cy + radius)
    if shape == "circle":
        draw.ellipse(box, fill=rgb)
    elif shape == "square":
        draw.rectangle(box, fill=rgb)
    else:
        draw.polygon(
            [(cx, cy - radius), (cx - radius, cy + radius * 0.8), (cx + radius, cy + radius * 0.8)],
            fill=rgb,
        )
    pixels[...] = np.asarray(image)


def _draw_scene(rng: random.Random, scene: dict[str, Any]) -> np.ndarray:
    width, height = rng.choice((96, 128, 160)), rng.choice((96, 128, 160))
    pixels = _background(rng, width, height)
    radius = rng.uniform(0.15, 0.2) * min(width, height)
    if scene["count"] == 1:
        cx, cy = _position_centre(rng, scene["position"], width, height)
        _draw_shape(pixels, scene["shape"], scene["colour"], cx, cy, radius, rng)
        return pixels
    cells = rng.sample([(col, row) for col in range(2) for row in range(2)], scene["count"])
    cell_w, cell_h = width / 2, height / 2  # one shape per quarter: never overlapping
    centres = [
        (
            (col + 0.5) * cell_w + rng.uniform(-1, 1) * (cell_w / 2 - radius),
            (row + 0.5) * cell_h + rng.uniform(-1, 1) * (cell_h / 2 - radius),
        )
        for col, row in cells
    ]
    for cx, cy in centres:
        _draw_shape(pixels, scene["shape"], scene["colour"], cx, cy, radius, rng)
    return pixels


def _position_centre(
    rng: random.Random, position: str, width: int, height: int
) -> tuple[float, float]:
    near, mid = rng.uniform(0.22, 0.3), rng.uniform(0.4, 0.6)
    far = 1.0 - near
    x, y = {"left": (near, mid), "right": (far, mid), "top": (mid, near), "bottom": (mid, far)}[
        position
    ]
    return x * width, y * height


def _draw_motion(rng: random.Random, motion: dict[str, Any]) -> np.ndarray:
    """[VIDEO_FRAMES, H, W, 3]: the shape crosses most of the frame in `direction`."""
    size = VIDEO_SIZE
    background = _background(rng, size, size)
    radius = rng.uniform(0.15, 0.2) * size
    start, end = rng.uniform(0.2, 0.3), rng.uniform(0.7, 0.8)
    across = rng.uniform(0.3, 0.7)
    sign = 1 if motion["direction"] in ("right", "down") else -1
    frames = []
    for t in np.linspace(0.0, 1.0, VIDEO_FRAMES):
        along = start + (end - start) * (t if sign > 0 else 1 - t)
        x, y = (along, across) if motion["direction"] in ("left", "right") else (across, along)
        frame = background.copy()
        _draw_shape(
            frame,
            motion["shape"],
            motion["colour"],
            x * size,
            y * size,
            radius,
            random.Random(rng.random()),
        )
        frames.append(frame)
    return np.stack(frames)


def _synth(rng: random.Random, sound: dict[str, Any]) -> np.ndarray:
    """Evenly spread beeps of one pitch and loudness, with a little noise."""
    total = int(sound["seconds"] * SAMPLE_RATE)
    hz = rng.uniform(*PITCHES[sound["pitch"]])
    amplitude = rng.uniform(*LOUDNESS[sound["loudness"]])
    slot = sound["seconds"] / sound["beeps"]
    beep = rng.uniform(0.3, 0.5) * min(slot, 0.5)
    noise = np.random.default_rng(rng.getrandbits(32)).normal(0.0, 0.002, total)
    waveform = noise.astype(np.float32)
    ramp = int(0.01 * SAMPLE_RATE)
    for k in range(sound["beeps"]):
        begin = int((k * slot + rng.uniform(0.1, 0.4) * (slot - beep)) * SAMPLE_RATE)
        length = int(beep * SAMPLE_RATE)
        envelope = np.ones(length, np.float32)
        envelope[:ramp], envelope[-ramp:] = np.linspace(0, 1, ramp), np.linspace(1, 0, ramp)
        tone = np.sin(2 * np.pi * hz * np.arange(length) / SAMPLE_RATE) * envelope * amplitude
        waveform[begin : begin + length] += tone.astype(np.float32)
    return waveform


# --- files --------------------------------------------------------------------------------------


def _png(pixels: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _wav(waveform: np.ndarray) -> bytes:
    import soundfile

    buf = io.BytesIO()
    soundfile.write(buf, waveform, SAMPLE_RATE, format="WAV")
    return buf.getvalue()


def _mp4(frames: np.ndarray, waveform: np.ndarray | None = None) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        video = container.add_stream("libx264", rate=VIDEO_FPS, options={"crf": "12"})
        video.width, video.height, video.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        audio = (
            container.add_stream("aac", rate=SAMPLE_RATE, layout="mono")
            if waveform is not None
            else None
        )  # every stream must exist before muxing
        for pixels in frames:
            container.mux(video.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(video.encode())
        if audio is not None:
            for offset in range(0, len(waveform), 1024):
                frame = av.AudioFrame.from_ndarray(
                    waveform[None, offset : offset + 1024], format="flt", layout="mono"
                )
                frame.sample_rate, frame.pts = SAMPLE_RATE, offset
                container.mux(audio.encode(frame))
            container.mux(audio.encode())
    return buf.getvalue()


def _data_url(media_type: str, data: bytes) -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


# --- the task table (after the functions it names) ---------------------------------------------

_SINGLE_MEDIA = {  # task -> (draw the content, its question and answer, file field, render)
    "image": (_scene, _image_qa, "image", lambda rng, scene: _png(_draw_scene(rng, scene))),
    "audio": (_sound, _audio_qa, "audio", lambda rng, sound: _wav(_synth(rng, sound))),
    "video": (_motion, _video_qa, "video",
              lambda rng, motion: _mp4(_draw_motion(rng, motion))),
}  # fmt: skip


_MAKERS = {
    **{task: functools.partial(_single_media_example, task) for task in _SINGLE_MEDIA},
    "audio_in_video": _audio_in_video_example, "image_audio": _image_audio_example,
    "text": _text_example,
}  # fmt: skip
