"""Video-MME on LLaVA-OneVision with the MMLU role structure adapted to the video.

Data (``--data-path DIR`` is required: the videos are not in the annotation split):

* ``DIR`` is a local copy of the hub repo ``lmms-lab/Video-MME`` with its video archives unzipped
  (``git clone`` or ``huggingface-cli download lmms-lab/Video-MME --repo-type dataset --local-dir
  DIR``, then ``cd DIR && for f in videos_chunked_*.zip; do unzip -n "$f"; done``), i.e.
  ``DIR/videomme/test-00000-of-00001.parquet`` and ``DIR/data/<videoID>.mp4``.
* Videos are looked up as ``<videoID>.mp4`` (also .mkv/.webm/.avi/.mov) in ``DIR/data``,
  ``DIR/videos``, ``DIR/video`` or ``DIR``; decoding needs PyAV (``pip install av``). Instead of a
  video file, a folder of extracted frames ``DIR/frames/<videoID>/`` (or ``DIR/<videoID>/``) of
  .jpg/.png images in name order is used as is, without PyAV.
* Annotations: the first of ``DIR/videomme/*.parquet``, ``DIR/*.parquet``, ``DIR/*.jsonl``; if DIR
  has none, the ``test`` split of ``lmms-lab/Video-MME`` is loaded through ``datasets``.

Each sample's video is sampled to 32 frames uniformly over its length, every frame resized to the
vision tower's 384x384 input and pooled to 196 tokens by the model (6273 visual tokens with the
trailing newline), shared by all agents as the visual PH segment. Scoring: the option letter (A-D).
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import BenchError
from .base import DataRow, Role, Workload, first_line, indexed_rows, jsonl_rows, load_hub, register
from .mmlu import extract_letter
from .visual import VisualContent, VisualSample, sample_frame_indices

REPO = "lmms-lab/Video-MME"
SPLIT = "test"
LETTERS = "ABCD"
VIDEO_EXTS = (".mp4", ".mkv", ".webm", ".avi", ".mov")
FRAME_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
VIDEO_DIRS = ("data", "videos", "video", ".")
FRAME_DIRS = ("frames", ".")

_FORMAT = "Answer with exactly one of the letters A, B, C or D, the letter of the correct option."

ROLES = (
    Role(
        "Knowledgeable Expert",
        "You are a knowledgeable expert. Identify the key entities, people, objects and events in the "
        "video that the question is about and recall what is known about them.",
        "Name the key entities and events in the video relevant to this question and what you know "
        "about them. Then say which option you think is correct.",
    ),
    Role(
        "Wiki Searcher",
        "You are a Wikipedia searcher. You look up and summarize encyclopedic knowledge relevant to a "
        "question about a video.",
        "Summarize the encyclopedic knowledge and the details of the video that decide this question, "
        "using the analyses above. Then say which option it supports.",
    ),
    Role(
        "Critic",
        "You are an excellent critic. You examine other agents' reasoning about a video and point out mistakes.",
        "Check the analyses above against the video for errors and say which option is correct and why.",
    ),
)

FINAL = Role(
    "FinalRefer",
    "You are the final decision maker. You read the analyses of other agents and give the final "
    "answer to a multiple-choice question about a video.",
    "Based on the video, the question and the analyses above, give the final answer. "
    + _FORMAT
    + " Reply in the form: Answer: X",
)


def format_question(question: str, options: list[str]) -> str:
    """The question and its options, each option as ``X. text`` (Video-MME ships them so)."""
    lines = []
    for i, o in enumerate(options):
        o = str(o).strip()
        lines.append(o if re.match(rf"^{LETTERS[i]}[.)]\s", o) else f"{LETTERS[i]}. {o}")
    return f"{question.strip()}\n" + "\n".join(lines)


def find_video(root: Path, video_id: str) -> Path | None:
    """The video file or frame folder of ``video_id`` under ``root``, or None."""
    for d in FRAME_DIRS:
        p = root / d / video_id
        if p.is_dir():
            return p
    for d in VIDEO_DIRS:
        for ext in VIDEO_EXTS:
            p = root / d / (video_id + ext)
            if p.is_file():
                return p
    return None


def read_frames(path: Path, n: int) -> list:
    """``n`` frames sampled uniformly (first and last included) from a video file or frame folder."""
    from PIL import Image

    if path.is_dir():
        files = sorted(f for f in path.iterdir() if f.suffix.lower() in FRAME_EXTS)
        if not files:
            raise BenchError(f"frame folder {path} holds no .jpg/.png frames")
        out = []
        for i in sample_frame_indices(len(files), n):
            with Image.open(files[i]) as im:
                out.append(im.convert("RGB"))
        return out
    try:
        import av
    except ImportError:
        raise BenchError(
            f"decoding {path.name} needs PyAV: run `pip install av` (or extract frames into "
            f"{path.parent / 'frames' / path.stem}/)"
        ) from None
    try:
        return _decode(av, path, n)
    except BenchError:
        raise
    except Exception as exc:  # noqa: BLE001 - corrupt or unsupported video
        lines = [ln for ln in str(exc).splitlines() if ln.strip()] or [type(exc).__name__]
        raise BenchError(f"cannot decode video {path}: {lines[0].strip()}") from None


def _decode(av, path: Path, n: int) -> list:
    """Decode the frames at ``n`` uniformly spread indices: sequentially for short videos, by
    seeking to each frame's timestamp for long ones (Video-MME has hour-long videos)."""

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        total = int(stream.frames or 0)
        rate = float(stream.average_rate or 0)
        if total > SEEK_ABOVE and rate > 0 and stream.time_base is not None:
            try:
                return _decode_seeking(container, stream, sample_frame_indices(total, n), rate)
            except Exception:  # noqa: BLE001 - unseekable stream: decode sequentially instead
                container.seek(0)
        if total <= 0:  # no frame count in the header: decode everything once
            frames = [f.to_image() for f in container.decode(stream)]
            if not frames:
                raise BenchError(f"video {path} has no frames")
            return [frames[i] for i in sample_frame_indices(len(frames), n)]
        wanted = sample_frame_indices(total, n)
        need = set(wanted)
        picked: dict[int, object] = {}
        for i, frame in enumerate(container.decode(stream)):
            if i in need:
                picked[i] = frame.to_image()
            if i >= wanted[-1]:
                break
        if not picked:
            raise BenchError(f"video {path} has no frames")
        # a header frame count can exceed the decodable frames: use the nearest earlier decoded frame
        keys = sorted(picked)
        return [picked[max([k for k in keys if k <= i] or keys[:1])] for i in wanted]


#: videos with more frames than this are sampled by seeking instead of decoding every frame
SEEK_ABOVE = 3000


def _decode_seeking(container, stream, wanted: list[int], rate: float) -> list:
    """For each wanted frame index, seek to the keyframe before its timestamp and decode up to the
    first frame at or after it (the last frame decoded if the stream ends first)."""
    tb = float(stream.time_base)
    start = float(stream.start_time or 0) * tb
    out = []
    for idx in wanted:
        t = start + idx / rate
        container.seek(int(t / tb), stream=stream, backward=True, any_frame=False)
        chosen = None
        for frame in container.decode(stream):
            chosen = frame
            if frame.pts is not None and frame.pts * tb >= t - 0.5 / rate:
                break
        if chosen is None:
            raise RuntimeError("seek decoded no frame")
        out.append(chosen.to_image())
    return out


@register
class VideoMME(Workload):
    name = "videomme"
    summary = "Video-MME multiple choice on 32 frames (lmms-lab/Video-MME, videos in --data-path), MMLU roles"
    modality = "video"
    roles = ROLES
    final_role = FINAL
    default_tau = 0.60
    max_new_tokens = 64
    final_max_new_tokens = 16
    frames = 32

    def load(self) -> list:
        if not self.data_path:
            raise BenchError(
                f"videomme needs --data-path DIR holding the {REPO} videos (DIR/data/<videoID>.mp4 "
                "or DIR/frames/<videoID>/); see kvcmas_bench/workloads/videomme.py"
            )
        root = Path(self.data_path).expanduser()
        if not root.is_dir():
            raise BenchError(f"Video-MME data folder not found: {self.data_path}")
        questions = [self._question(row) for row in self._annotations(root)]
        if not questions:
            raise BenchError(f"no Video-MME questions in the annotations for {root}")
        found = {v: find_video(root, v) for v in {q["videoID"] for q in questions}}
        if not any(found.values()):
            raise BenchError(
                f"no Video-MME videos under {root} (expected {root}/data/<videoID>.mp4 or "
                f"{root}/frames/<videoID>/ for videoIDs like {questions[0]['videoID']})"
            )
        return [self._sample(q, root, found) for q in questions]

    def _annotations(self, root: Path) -> list[DataRow]:
        files = (
            sorted((root / "videomme").glob("*.parquet"))
            + sorted(root.glob("*.parquet"))
            + sorted(root.glob("*.jsonl"))
        )
        if not files:
            return self._load_hub()
        path = files[0]
        if path.suffix == ".jsonl":
            return jsonl_rows(path, "Video-MME annotations", "Video-MME")
        try:
            import pandas as pd

            records = pd.read_parquet(path).to_dict(orient="records")
        except Exception as exc:  # noqa: BLE001 - unreadable annotation file
            raise BenchError(f"cannot read Video-MME annotations {path}: {first_line(exc)}") from None
        return indexed_rows(records, "Video-MME", path)

    @staticmethod
    def _load_hub() -> list[DataRow]:
        rows = load_hub(REPO, split=SPLIT, what=f"Video-MME annotations ({REPO}, split {SPLIT})")
        return indexed_rows(rows, "Video-MME", REPO)

    @staticmethod
    def _question(row: DataRow) -> dict:
        """The fields of one annotation row, checked (one line naming the file and row on a bad one)."""
        vid = row.scalar("videoID")
        options = row.strings("options", length=4)
        gold = row.text("answer").strip().upper()
        if gold not in LETTERS:
            raise row.error(f"field 'answer' must be one of A, B, C, D, got {row.data['answer']!r}")
        return {
            "row": row.data,
            "videoID": vid,
            "options": options,
            "gold": gold,
            "question": row.text("question"),
            "qid": row.scalar("question_id", required=False) or f"{vid}-{row.index}",
        }

    def _sample(self, q: dict, root: Path, found: dict):
        r, vid, gold, qid = q["row"], q["videoID"], q["gold"], q["qid"]
        query = format_question(q["question"], q["options"])
        n = self.frames
        key = f"videomme:{vid}:{n}"

        def visual():
            path = found.get(vid)
            if path is None:
                raise BenchError(f"Video-MME video {vid} not found under {root} (data/{vid}.mp4 or frames/{vid}/)")
            return VisualContent("video", read_frames(path, n), key=key)

        meta = {
            "video_id": str(r.get("video_id", "")),
            "videoID": vid,
            "question_id": qid,
            "duration": r.get("duration"),
            "domain": r.get("domain"),
            "sub_category": r.get("sub_category"),
            "task_type": r.get("task_type"),
        }
        return VisualSample(id=f"videomme-{qid}", query=query, gold=gold, meta=meta, visual=visual, visual_key=key)

    def score(self, sample, output: str) -> tuple[str | None, bool]:
        pred = extract_letter(output)
        return pred, self.judge(pred, sample.gold)
