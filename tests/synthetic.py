"""Small synthetic run and sweep directories written the way the jobs write them (for report and
compare tests that need exact, hand-chosen figures and no model)."""

from __future__ import annotations

import json
from pathlib import Path

from kvcmas_bench.results.request import RequestRecord, SegmentRecord

GOLD = ["A", "B", "C", "D", "A", "B"]
#: the MMLU data of synthetic runs (readers check each record's gold against it): 16 questions, ids
#: mmlu-0 .. mmlu-15, gold answers :data:`GOLD` at 0-5 and again at 10-15 (A, B, C, D at 6-9)
DATA = str(Path(__file__).parent / "data" / "mmlu-synthetic.jsonl")


def config(method: str, **over) -> dict:
    cfg = {
        "method": method,
        "method_config": {"name": method},
        "workload": "mmlu",
        "model": "tiny-model",
        "dtype": "float32",
        "device": "cpu",
        "seed": 0,
        "limit": len(GOLD),
        "subjects": None,
        "data_path": DATA,
        "max_new_tokens": 4,
        "final_max_new_tokens": 2,
        "fidelity": False,
        "topology": "chain",
        "n_agents": 2,
        "rounds": 1,
        "calibration_samples": [],
        "target_reuse": None,
        "auto_tau": None,
        "versions": {"torch": "x", "transformers": "y"},
        "hardware": {"cpu_count": 2, "device": "cpu"},
    }
    cfg.update(over)
    return cfg


def requests_for(sample_id: str, rho: float, ttft: float, first_tokens: tuple[int, int], state: int, fidelity: bool):
    """Two agent requests: a dense first agent, then one reusing 10 shared tokens over 2 layers at ``rho``."""
    recomputed = round((1 - rho) * 20)
    seg = SegmentRecord(
        "PH",
        10,
        status="reused" if recomputed == 0 else "recomputed",
        slot="q",
        source_agent="A0",
        eligible=True,
        reused_tokens=10,
        recomputed_token_layers=recomputed,
        kv_rel_error=(0.1 * rho if fidelity else None),
    )
    common = dict(sample_id=sample_id, layers=2, peak_rss_bytes=100 * 2**20, kv_bytes=2**20, method_state_bytes=state)
    first = RequestRecord(
        "A0",
        ttft,
        2 * ttft,
        step=0,
        node="A0#0",
        first_token_id=first_tokens[0],
        prompt_tokens=30,
        prefilled_tokens=30,
        output_tokens=4,
        kv_state_bytes=2**20 + state,
        **common,
    )
    second = RequestRecord("Final", ttft, 2 * ttft, step=1, node="Final#1", first_token_id=first_tokens[1],
                           prompt_tokens=40, prefilled_tokens=30, reused_tokens=10, eligible_tokens=10,
                           recomputed_token_layers=recomputed, output_tokens=2, segments=[seg],
                           kv_state_bytes=2**20 + state, **common)  # fmt: skip
    if fidelity:
        for r in (first, second):
            r.top1_agree, r.first_token_kl = True, 0.01 * rho
        second.kv_rel_error = seg.kv_rel_error
    return [first, second]


def make_run(
    path: Path,
    method: str,
    preds: list[str],
    *,
    rho: float = 1.0,
    ttft: float = 0.1,
    latency: float = 1.0,
    first_tokens: list[tuple[int, int]] | None = None,
    state: int = 0,
    fidelity: bool = False,
    **cfg,
) -> Path:
    """A run directory of ``len(preds)`` MMLU-like samples with gold answers :data:`GOLD`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c = config(method, fidelity=fidelity, **cfg)
    (path / "config.json").write_text(json.dumps(c, indent=1))
    samples, reqs = [], []
    for i, p in enumerate(preds):
        sid = f"mmlu-{i}"
        samples.append(
            {
                "sample_id": sid,
                "gold": GOLD[i],
                "prediction": p,
                "correct": p == GOLD[i],
                "latency_s": latency,
                "ttft_s": ttft,
                "final_output": f"Answer: {p}",
                "meta": {"subject": "x"},
            }  # fmt: skip
        )
        ft = first_tokens[i] if first_tokens else (7, 8)
        reqs += requests_for(sid, rho, ttft, ft, state, fidelity)
    (path / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    (path / "requests.jsonl").write_text("".join(json.dumps(r.to_dict()) + "\n" for r in reqs))
    return path


def make_matrix(root: Path) -> dict[str, Path]:
    """NonShared, FullShared, KVCMAS and CacheBlend at two rho on 6 samples, with hand-chosen figures:

    ======================  ========  ==========  =====  =====
    run                     accuracy  agreement   E2E s  rho
    ======================  ========  ==========  =====  =====
    nonshared               4/6       1           2.0    0
    fullshared              2/6       3/6         1.0    1
    kvcmas                  5/6       5/6         1.2    0.8
    cacheblend rho=0.9      3/6       4/6         1.9    0.9
    cacheblend rho=0.5      4/6       6/6         50.0   0.5  (far outside the frame)
    ======================  ========  ==========  =====  =====
    """
    ref = ["A", "B", "C", "D", "B", "A"]  # 4 correct
    runs = {
        "nonshared": make_run(root / "ns", "nonshared", ref, rho=0.0, latency=2.0, ttft=0.2, fidelity=True),
        "fullshared": make_run(
            root / "fs",
            "fullshared",
            ["A", "C", "D", "D", "B", "C"],
            latency=1.0,
            ttft=0.1,
            fidelity=True,
            first_tokens=[(7, 9)] * 6,
        ),  # fmt: skip
        "kvcmas": make_run(
            root / "kv",
            "kvcmas",
            ["A", "B", "C", "D", "B", "B"],
            rho=0.8,
            latency=1.2,
            ttft=0.12,
            state=4 * 2**20,
            fidelity=True,
            first_tokens=[(7, 8)] * 5 + [(7, 9)],
        ),  # fmt: skip
        "cacheblend-0.9": make_run(
            root / "cb9",
            "cacheblend",
            ["A", "B", "C", "C", "B", "C"],
            rho=0.9,
            latency=1.9,
            ttft=0.19,
            method_config={"name": "cacheblend", "rho": 0.9},
        ),  # fmt: skip
        "cacheblend-0.5": make_run(
            root / "cb5",
            "cacheblend",
            ref,
            rho=0.5,
            latency=50.0,
            ttft=0.5,
            method_config={"name": "cacheblend", "rho": 0.5},
        ),  # fmt: skip
    }
    return runs


def make_sweep(path: Path) -> Path:
    """A serve-sweep directory with NonShared and KVCMAS at QPS 0, 0.25 and 8 (8: saturated)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rows = []
    for method, service in (("nonshared", 2.125), ("kvcmas", 1.5)):
        for qps in (0.0, 0.25, 8.0):
            util = qps * service if qps else None
            rows.append(
                {
                    "method": method,
                    "shared_tokens": 2048,
                    "qps": qps,
                    "utilization": util,
                    "saturated": bool(util is not None and util >= 1),
                    "trajectory_service_mean_s": service,
                    "ttft_p50_s": 0.1 * (1 + qps),
                    "ttft_p90_s": 0.2 * (1 + qps),
                    "ttft_p99_s": 0.3 * (1 + qps),
                    "ttft_mean_s": 0.15 * (1 + qps),
                    "throughput_tok_s": 100.0,
                    "peak_mem_bytes": 300 * 2**20,
                    "kv_state_peak_bytes": 50 * 2**20,
                    "reuse_ratio": 0.0 if method == "nonshared" else 0.8,
                }  # fmt: skip
            )
    from kvcmas_bench.serving.metrics import capacity

    cfg = {"command": "serve-sweep", "model": "tiny-model", "device": "cpu", "seed": 0, "traces_sha256": "abc",
           "num_trajectories": 2, "burstiness": 1.0, "qps": [0.0, 0.25, 8.0], "methods": ["nonshared", "kvcmas"],
           "shared_tokens": [2048], "hardware": {"cpu_count": 2}, "dtype": "float32"}  # fmt: skip
    summary = {"model": "tiny-model", "device": "cpu", "engine": "in-process", "rows": rows, "capacity": capacity(rows)}
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "summary.json").write_text(json.dumps(summary))
    return path
