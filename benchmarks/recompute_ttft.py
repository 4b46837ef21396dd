"""Benchmark: TTFT of a reuse request under selective recomputation vs NonShared and FullShared.

One run on the default model (SmolLM2-135M unless --model): agent A prefills
``[PF_A, shared, tail]`` densely; agent B's request ``[PF_B, shared, tail]`` is then served by each
method with A's cache as the source, and its TTFT (prefill incl. recomputation, to the first token)
is measured ``--repeats`` times (median). DroidSpeak and RelayCaching are calibrated first on
observations of other shared texts. Printed side by side, with each TTFT relative to NonShared.

    python benchmarks/recompute_ttft.py [--shared-tokens 2048] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common import prefix, shared_ids

from kvcmas_bench.calibration import Recorder
from kvcmas_bench.engine import Engine, Request, Segment
from kvcmas_bench.methods import get_method
from kvcmas_bench.modeling import load_model


def requests(tok, seg: list[int]) -> tuple[Request, Request]:
    tail = tok("\n\nAnswer briefly.<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    a = Request("A", [Segment("PF", prefix(tok, "planner")), Segment("PH", seg, slot="ctx"), Segment("PF", tail)], 1)
    b = Request(
        "B", [Segment("PF", prefix(tok, "critic")), Segment("PH", seg, slot="ctx", source="A"), Segment("PF", tail)], 1
    )
    return a, b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--shared-tokens", type=int, default=2048)
    ap.add_argument("--calib-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    lm = load_model(args.model, args.dtype, args.device)
    engine = Engine(lm.model, lm.tokenizer)
    tok = lm.tokenizer
    rec = Recorder()
    for off in (1000, 2000):
        ca, cb = requests(tok, shared_ids(tok, args.calib_tokens, offset=off))
        src = engine.run(ca, rec).materialized["ctx"]
        engine.run(cb, rec, sources={"ctx": src})
    ra, rb = requests(tok, shared_ids(tok, args.shared_tokens))
    # DroidSpeak/RelayCaching enter from the source's hidden states: prefill A keeping them
    configs = [("nonshared", {}), ("fullshared", {})] + [
        (m, {"rho": rho}) for rho in (0.9, 0.8) for m in ("cacheblend", "droidspeak", "relaycaching")
    ]
    print(
        f"model {lm.name}, device {engine.device}, shared tokens {args.shared_tokens}, "
        f"B prompt {len(rb.prompt_ids)} tokens, median of {args.repeats}"
    )
    print(
        f"{'method':<14} {'rho':>5} {'TTFT (s)':>9} {'vs NonShared':>13} "
        f"{'recomputed token-layers':>24} {'rho measured':>13}"
    )
    base = None
    for name, kw in configs:
        m = get_method(name, **kw)
        if m.needs_calibration:
            m.calibrate(rec.observations, engine.n_layers)
        src = engine.run(ra, m).materialized["ctx"]
        times, res = [], None
        for _ in range(args.repeats):
            res = engine.run(rb, m, sources={"ctx": src})
            times.append(res.ttft_s)
        t = statistics.median(times)
        base = base or t
        eligible = res.eligible_tokens * engine.n_layers
        rho_m = (res.reused_tokens * engine.n_layers - res.recomputed_token_layers) / eligible if eligible else 0.0
        print(
            f"{name:<14} {kw.get('rho', '-'):>5} {t:>9.3f} {t / base:>12.2f}x {res.recomputed_token_layers:>24} "
            f"{rho_m:>13.3f}"
        )


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
