"""The talker role with a Piper voice: text → espeak-ng phonemes → VITS (ONNX) → PCM.

Selected by the model folder's kind (``config.json`` ``model_type`` piper, written by
``omniflow models pull piper-joe``). ``piper-tts`` phonemises with the espeak-ng data it
bundles and synthesises one sentence at a time; each sentence's audio is streamed as soon as
it is ready, resampled (one soxr stream over the utterance, so no seams between chunks)
from the voice's rate to the rate asked for. The last chunk carries the whole WAV.

Rates: ``sample_rate`` 0 gives the worker API's 16 kHz (the rate every talker answers 0
with, so a client need not know the voice); any rate from 8 to 48 kHz is served, the voice's
own (22,050 Hz for en_US-joe-medium) without resampling. Piper draws its noise inside the
ONNX graph, so ``seed`` cannot fix it: two runs of one text differ slightly.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from omniflow.errors import FailedPrecondition, InvalidArgument
from omniflow_services.worker.mm.audio_io import StreamResampler, pcm_s16
from omniflow_services.worker.mm.media import wav_bytes
from omniflow_services.worker.mm.talker import AudioChunk, Talker, check_voice

log = logging.getLogger(__name__)

PIPER_MODEL_TYPE = "piper"
MAX_TEXT_CHARS = 4000


def is_piper_folder(folder: Path) -> bool:
    path = folder / "config.json"
    return path.is_file() and json.loads(path.read_text()).get("model_type") == PIPER_MODEL_TYPE


class PiperTalker(Talker):
    """One Piper voice; one utterance is synthesised at a time (ONNX threads are the
    parallelism)."""

    def __init__(self, folder: Path, threads: int = 1) -> None:
        try:
            import onnxruntime
            from piper import PiperVoice
            from piper.config import PiperConfig
        except ImportError:
            raise FailedPrecondition(
                "a Piper voice needs piper-tts and onnxruntime: pip install 'omniflow[worker]'"
            ) from None
        meta = json.loads((folder / "config.json").read_text())
        if meta.get("model_type") != PIPER_MODEL_TYPE:
            raise InvalidArgument(
                f"{folder} holds model_type {meta.get('model_type')!r}, not piper"
            )
        onnx = folder / str(meta.get("onnx", ""))
        voice_cfg = folder / str(meta.get("voice_config", f"{onnx.name}.json"))
        for p in (onnx, voice_cfg):
            if not p.is_file():
                raise InvalidArgument(f"the Piper voice folder {folder} lacks {p.name}")
        opts = onnxruntime.SessionOptions()
        opts.intra_op_num_threads = max(1, threads)
        opts.inter_op_num_threads = 1
        session = onnxruntime.InferenceSession(
            str(onnx), sess_options=opts, providers=["CPUExecutionProvider"]
        )
        config = PiperConfig.from_dict(json.loads(voice_cfg.read_text()))
        self.voice = PiperVoice(session=session, config=config)
        self.name = str(meta.get("voice") or onnx.stem)
        self.voice_rate = int(config.sample_rate)
        self._lock = threading.Lock()

    @property
    def sample_rate(self) -> int:
        """The voice's own rate."""
        return self.voice_rate

    def check_voice(self, voice: str) -> None:
        check_voice(voice, self.name)

    def check_text(self, text: str) -> None:
        if not text.strip():
            raise InvalidArgument("text is empty: send the text to speak")
        if len(text) > MAX_TEXT_CHARS:
            raise InvalidArgument(
                f"text has {len(text)} characters; the talker accepts up to {MAX_TEXT_CHARS}"
            )

    def synthesize_sync(
        self, text: str, sample_rate: int = 0, seed: int | None = None
    ) -> Iterator[AudioChunk]:
        """One chunk per sentence as Piper finishes it; the last carries the whole WAV.
        ``seed`` is accepted and has no effect (see the module doc)."""
        self.check_text(text)
        rate = self.output_rate(sample_rate)
        with self._lock:
            # Counted first (phonemizing is a millisecond) so each sentence leaves as soon as
            # it is spoken, the last one knowing it is last: holding one back to find out
            # would make the first audio of a two-sentence text wait for both.
            count = sum(1 for phonemes in self.voice.phonemize(text) if phonemes)
            resample = StreamResampler(self.voice_rate, rate)
            parts: list[bytes] = []
            index = 0
            for sentence in self.voice.synthesize(text):
                out = resample(sentence.audio_float_array)
                if index == count - 1:
                    break  # the last: it takes the resampler's tail below
                pcm = pcm_s16(out)
                parts.append(pcm)
                yield AudioChunk(pcm, rate, index, False)
                index += 1
            else:
                out = np.zeros(0, np.float32)  # no sentence left to speak (or none at all)
            out = np.concatenate([out, resample(np.zeros(0, np.float32), last=True)])
            pcm = pcm_s16(out)
            parts.append(pcm)
            yield AudioChunk(pcm, rate, index, True, wav_bytes(b"".join(parts), rate))
