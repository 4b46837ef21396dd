"""Benchmark: TTFT of a reuse request under selective recomputation vs NonShared and FullShared.

One run on the default model (SmolLM2-135M unless --model): agent A prefills
``[PF_A, shared, tail]`` densely; agent B's request ``[PF_B, shared, tail]`` is then served by each
method with A's cache as the source, and its TTFT (prefill incl. recomputation, to the first token)
is measured ``--repeats`` times after one untimed run: min / median / max and the spread
(max - min) / median, flagged "SPREAD > 20%: not reproducible on this machine now" above 20%.
DroidSpeak and RelayCaching are calibrated first on observations of two other shared texts of
``--calib-tokens`` tokens. Printed side by side, each median TTFT relative to NonShared's; the
output starts with the command line, date and git revision.

    python benchmarks/recompute_ttft.py [--shared-tokens 2048] [--calib-tokens 512] [--repeats 5]
        [--model NAME] [--device auto] [--dtype float32]
"""

from __future__ import annotations

import argparse

import torch
from common import FLAG, prefix, print_header, record, shared_ids, spread_verdict, timed

from kvcmas_bench.calibration import Recorder
from kvcmas_bench.engine import Engine
from kvcmas_bench.methods import get_method
from kvcmas_bench.modeling import load_model
from kvcmas_bench.segments import Request, Segment


def requests(tok, seg: list[int]) -> tuple[Request, Request]:
    tail = tok("\n\nAnswer briefly.<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    a = Request("A", [Segment("PF", prefix(tok, "planner")), Segment("PH", seg, slot="ctx"), Segment("PF", tail)], 1)
    b = Request(
        "B", [Segment("PF", prefix(tok, "critic")), Segment("PH", seg, slot="ctx", source="A"), Segment("PF", tail)], 1
    )
    return a, b


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--model", default=None, help="model name or path (None: the packaged SmolLM2-135M-Instruct)")
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ap.add_argument("--dtype", default="float32", help="model dtype")
    ap.add_argument("--shared-tokens", type=int, default=2048, help="tokens of the shared text")
    ap.add_argument("--calib-tokens", type=int, default=512, help="tokens of each of the two calibration texts")
    ap.add_argument("--repeats", type=int, default=5, help="timed requests per method, after one untimed")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    print_header()
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
        f"model {lm.name}, device {engine.device}, torch threads {torch.get_num_threads()}, shared tokens "
        f"{args.shared_tokens}, B prompt {len(rb.prompt_ids)} tokens; TTFT min / median / max of {args.repeats} "
        f"after one untimed run, spread = (max - min) / median; ratios from medians"
    )
    print(
        f"{'method':<14} {'rho':>5} {'TTFT min / median / max (s)':>29} {'spread':>7} {'vs NonShared':>13} "
        f"{'recomputed token-layers':>24} {'rho measured':>13}"
    )
    base = None
    for name, kw in configs:
        m = get_method(name, **kw)
        if m.needs_calibration:
            m.calibrate(rec.observations, engine.n_layers)
        src = engine.run(ra, m).materialized["ctx"]
        t = timed(
            lambda m=m, src=src: engine.run(rb, m, sources={"ctx": src}),
            args.repeats,
            warmup=1,
            metric=lambda r: r.ttft_s,
        )
        record(t)  # counted for the closing spread line
        res = t.last
        base = base or t.median
        eligible = res.eligible_tokens * engine.n_layers
        rho_m = (res.reused_tokens * engine.n_layers - res.recomputed_token_layers) / eligible if eligible else 0.0
        cell = f"{t.min:.3f} / {t.median:.3f} / {t.max:.3f}"
        spread = f"{t.spread:.1%}" if t.n > 1 else "-"
        print(
            f"{name:<14} {kw.get('rho', '-'):>5} {cell:>29} {spread:>7} {t.median / base:>12.2f}x "
            f"{res.recomputed_token_layers:>24} {rho_m:>13.3f}{'  <-- ' + FLAG if t.unstable else ''}"
        )
    print(spread_verdict())


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
