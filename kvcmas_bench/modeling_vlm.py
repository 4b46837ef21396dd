"""Vision-language models: LLaVA-OneVision loading, its processor parts and visual features.

The language model inside a LLaVA-OneVision checkpoint is an ordinary Qwen2 decoder that the
engine runs like any text model; the vision tower, the projector and the ``image_newline`` vector
only produce the *input embeddings* of the visual tokens. This module computes those embeddings
with the model's own ``get_image_features`` / ``get_video_features`` (exactly the tensors its
``forward`` scatters into the image/video placeholder positions) and hands them to the engine as a
shared (PH) segment:

    Segment("PH", ids=[<image> id] * N, slot="image", embeds=features[N, hidden])

``ids`` are the very placeholder ids the model's processor puts into ``input_ids`` (the image or
video token repeated once per feature row), so ``Request.prompt_ids`` equals the ``input_ids`` of a
plain HF forward, token for token, and the engine feeds ``embeds`` in place of their embeddings.

Visual inputs: MathVista images go through the any-resolution path (``LlavaOnevisionImageProcessorPil``:
best grid pinpoint, tiles + base image; the model unpads, interpolates beyond ``anyres_max_9`` and
appends ``image_newline`` per row). Video-MME samples 32 frames uniformly, resizes each to the vision
tower's input size (384x384 for LLaVA-OneVision-7B), and the model pools each frame's 27x27 patch
grid to 14x14 = 196 tokens, plus one trailing ``image_newline`` for the video.

The processor is assembled from its parts (tokenizer, PIL image processor, chat template, token ids
from the model config) instead of ``AutoProcessor``: the stock ``LlavaOnevisionProcessor`` cannot be
built without torchvision, which this project does not depend on. Video frames are resized and
normalized here with PIL/numpy using the checkpoint's ``video_preprocessor_config.json`` mean/std.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import BenchError
from .modeling import LoadedModel, check_supported, resolve_device, resolve_dtype
from .workloads.visual import VIDEO_FRAMES, VisualContent, sample_frame_indices

#: OpenAI CLIP normalization, the default of ``LlavaOnevisionVideoProcessor``
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
EXAMPLE_MODEL = "llava-hf/llava-onevision-qwen2-7b-ov-hf"


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__


# ---- processor ---------------------------------------------------------------------------------


@dataclass
class VisualProcessor:
    """The parts of a LLaVA-OneVision processor the benchmark needs."""

    tokenizer: Any
    image_processor: Any
    chat_template: str | None
    image_token_id: int
    video_token_id: int
    image_token: str
    video_token: str
    frame_size: int
    frame_mean: tuple[float, ...] = CLIP_MEAN
    frame_std: tuple[float, ...] = CLIP_STD
    frame_rescale: float = 1 / 255
    num_frames: int = VIDEO_FRAMES

    def token(self, kind: str) -> str:
        return self.image_token if kind == "image" else self.video_token

    def token_id(self, kind: str) -> int:
        return self.image_token_id if kind == "image" else self.video_token_id

    @classmethod
    def from_pretrained(cls, path, config) -> VisualProcessor:
        """Tokenizer, image processor and chat template of a checkpoint (local folder or hub id)."""
        from transformers import AutoTokenizer, LlavaOnevisionImageProcessorPil

        where = str(path)
        try:
            tok = AutoTokenizer.from_pretrained(path)
        except Exception as exc:  # noqa: BLE001 - any loader failure is a missing/broken resource
            raise BenchError(f"no usable tokenizer in {where}: {_first_line(exc)}") from None
        local = Path(where) if Path(where).is_dir() else None
        if local is not None and not (local / "preprocessor_config.json").exists():
            raise BenchError(f"no image processor in {where} (preprocessor_config.json is missing)")
        try:
            image_processor = LlavaOnevisionImageProcessorPil.from_pretrained(path)
        except Exception as exc:  # noqa: BLE001
            raise BenchError(f"no usable image processor in {where}: {_first_line(exc)}") from None
        proc_cfg = _read_json(path, "processor_config.json") or {}
        video_cfg = _read_json(path, "video_preprocessor_config.json") or {}
        template = _chat_template(path, proc_cfg, tok)
        image_id, video_id = int(config.image_token_id), int(config.video_token_id)
        image_tok = proc_cfg.get("image_token") or tok.convert_ids_to_tokens(image_id)
        video_tok = proc_cfg.get("video_token") or tok.convert_ids_to_tokens(video_id)
        for name, t, i in (("image", image_tok, image_id), ("video", video_tok, video_id)):
            if not isinstance(t, str) or tok.convert_tokens_to_ids(t) != i:
                raise BenchError(
                    f"the tokenizer in {where} has no {name} token with id {i} (the model config's {name}_token_index)"
                )
        return cls(
            tokenizer=tok,
            image_processor=image_processor,
            chat_template=template,
            image_token_id=image_id,
            video_token_id=video_id,
            image_token=image_tok,
            video_token=video_tok,
            frame_size=int(config.vision_config.image_size),
            frame_mean=tuple(video_cfg.get("image_mean", CLIP_MEAN)),
            frame_std=tuple(video_cfg.get("image_std", CLIP_STD)),
            frame_rescale=float(video_cfg.get("rescale_factor", 1 / 255)),
        )

    # ---- pixel inputs ------------------------------------------------------------------------
    def image_inputs(self, images: Sequence) -> dict:
        """``pixel_values`` / ``image_sizes`` / ``batch_num_images`` of the images of one sample
        (one image: any-resolution tiles; several: base view each, as the processor does)."""
        rgb = [im.convert("RGB") for im in images]
        out = self.image_processor(images=[rgb], return_tensors="pt")
        return {k: out[k] for k in ("pixel_values", "image_sizes", "batch_num_images") if k in out}

    def video_inputs(self, frames: Sequence) -> torch.Tensor:
        """``pixel_values_videos`` ``[1, F, 3, S, S]`` of sampled frames: bicubic resize to S x S
        (S = the vision tower's input size, 384 for LLaVA-OneVision-7B), rescale, normalize."""
        from PIL import Image

        mean = np.asarray(self.frame_mean, dtype=np.float32)[:, None, None]
        std = np.asarray(self.frame_std, dtype=np.float32)[:, None, None]
        S = self.frame_size
        arrs = []
        for fr in frames:
            im = fr.convert("RGB").resize((S, S), Image.BICUBIC)
            x = np.asarray(im, dtype=np.float32).transpose(2, 0, 1) * self.frame_rescale
            arrs.append((x - mean) / std)
        return torch.from_numpy(np.stack(arrs))[None]


def _read_text(path, name: str) -> str | None:
    """A file of a checkpoint folder, or of a hub repo (from the local HF cache or the hub)."""
    p = Path(str(path)) / name
    if Path(str(path)).is_dir():
        try:
            return p.read_text(encoding="utf-8") if p.is_file() else None
        except (OSError, UnicodeDecodeError) as exc:
            raise BenchError(f"cannot read {p}: {_first_line(exc)}") from None
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(str(path), name)).read_text(encoding="utf-8")
    except Exception:  # noqa: BLE001 - optional file
        return None


def _read_json(path, name: str) -> dict | None:
    text = _read_text(path, name)
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise BenchError(f"cannot parse {name} of {path}: {_first_line(exc)}") from None


def _chat_template(path, proc_cfg: dict, tokenizer) -> str | None:
    """The processor's multimodal chat template: chat_template.jinja, chat_template.json, the
    processor config, or the tokenizer's template when it renders image items."""
    jinja = _read_text(path, "chat_template.jinja")
    if jinja and "image" in jinja:
        return jinja
    data = _read_json(path, "chat_template.json")
    if data and data.get("chat_template"):
        return data["chat_template"]
    if proc_cfg.get("chat_template"):
        return proc_cfg["chat_template"]
    own = getattr(tokenizer, "chat_template", None)
    return own if isinstance(own, str) and "'image'" in own else None


# ---- model -------------------------------------------------------------------------------------


@dataclass
class LoadedVLM(LoadedModel):
    processor: VisualProcessor | None = None


def load_vlm(spec: str | None, dtype: str = "float32", device: str = "cpu") -> LoadedVLM:
    """Load a LLaVA-OneVision checkpoint (HF id or local folder) and its processor parts."""
    from transformers import AutoConfig, LlavaOnevisionForConditionalGeneration

    torch_dtype = resolve_dtype(dtype)
    dev = resolve_device(device)
    if not spec:
        raise BenchError(f"the VLM workloads need --model with a LLaVA-OneVision checkpoint, e.g. {EXAMPLE_MODEL}")
    path: Path | str = Path(spec).expanduser()
    if Path(path).exists():
        if not Path(path).is_dir():
            raise BenchError(f"VLM model must be a checkpoint folder or HF id, not a file: {spec}")
        if not (Path(path) / "config.json").is_file():
            raise BenchError(f"no config.json in model folder {spec}")
    elif spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise BenchError(f"model not found: {spec} (not a local folder or HF id)")
    else:
        path = spec
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001
        raise BenchError(f"cannot load model config of {spec!r}: {_first_line(exc)}") from None
    if getattr(config, "model_type", None) != "llava_onevision":
        raise BenchError(
            f"{spec} is a {getattr(config, 'model_type', None)!r} model; the VLM workloads need "
            f"a LLaVA-OneVision checkpoint (model_type 'llava_onevision'), e.g. {EXAMPLE_MODEL}"
        )
    check_supported(config.text_config)
    if isinstance(path, Path) and not (any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin"))):
        raise BenchError(f"no model weights in {spec} (*.safetensors or pytorch_model*.bin missing)")
    processor = VisualProcessor.from_pretrained(path, config)
    try:
        model = LlavaOnevisionForConditionalGeneration.from_pretrained(path, dtype=torch_dtype)
    except Exception as exc:  # noqa: BLE001
        raise BenchError(f"cannot load LLaVA-OneVision weights of {spec!r}: {_first_line(exc)}") from None
    model.to(dev).eval()
    return LoadedVLM(model=model, tokenizer=processor.tokenizer, name=spec, source=str(path), processor=processor)


# ---- visual features ---------------------------------------------------------------------------


@dataclass
class VisualInput:
    """One sample's visual PH segment content: placeholder ids and the embeddings fed for them."""

    kind: str
    ids: list[int]
    embeds: torch.Tensor
    key: str
    encode_s: float = 0.0

    @property
    def tokens(self) -> int:
        return len(self.ids)


@torch.no_grad()
def image_features(
    model, pixel_values: torch.Tensor, image_sizes: torch.Tensor, batch_num_images: torch.Tensor | None = None
) -> torch.Tensor:
    """``[N, hidden]`` embeddings of the image tokens of one prompt, exactly those that
    ``LlavaOnevisionModel.forward`` scatters into its image placeholders (any-resolution tiles,
    unpadding, ``anyres_max`` interpolation and the ``image_newline`` rows included)."""
    base = model.model
    p = next(model.parameters())
    out = base.get_image_features(
        pixel_values.to(p.device, p.dtype),
        image_sizes.to(p.device),
        batch_num_images=batch_num_images,
        return_dict=True,
    )
    return torch.cat(out.pooler_output, dim=0)


@torch.no_grad()
def video_features(model, pixel_values_videos: torch.Tensor) -> torch.Tensor:
    """``[F * pooled + 1, hidden]`` embeddings of the video tokens, exactly as
    ``LlavaOnevisionModel.forward`` inserts them (per-frame 2x bilinear pooling of the patch grid,
    e.g. 27x27 -> 14x14 = 196 per 384x384 frame, then one ``image_newline`` row)."""
    p = next(model.parameters())
    out = model.model.get_video_features(pixel_values_videos.to(p.device, p.dtype), return_dict=True)
    return out.pooler_output.flatten(0, 1)


def encode_visual(model, processor: VisualProcessor, content: VisualContent) -> VisualInput:
    """Visual embeddings of one sample's content and their placeholder ids."""
    t0 = time.perf_counter()
    if content.kind == "image":
        inputs = processor.image_inputs(content.images)
        feats = image_features(model, inputs["pixel_values"], inputs["image_sizes"], inputs.get("batch_num_images"))
    else:
        frames = content.images
        if len(frames) != processor.num_frames:
            idx = sample_frame_indices(len(frames), processor.num_frames)
            frames = [frames[i] for i in idx]
        feats = video_features(model, processor.video_inputs(frames))
    if feats.device.type == "cuda":
        torch.cuda.synchronize(feats.device)
    key = content.key or hashlib.sha1(feats.float().cpu().numpy().tobytes()).hexdigest()
    ids = [processor.token_id(content.kind)] * feats.shape[0]
    return VisualInput(content.kind, ids, feats, key, time.perf_counter() - t0)


def tokens_per_frame(config) -> int:
    """Visual tokens of one video frame after LLaVA-OneVision's 2x pooling (196 for 384/14)."""
    side = config.vision_config.image_size // config.vision_config.patch_size
    return math.ceil(side / 2) ** 2
