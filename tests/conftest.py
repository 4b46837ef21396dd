"""Tiny random-weight models built by the tests themselves (the exact references)."""

from __future__ import annotations

import pytest
import torch

VOCAB = 96


def tiny_config(family: str = "llama", rope: dict | None = None, layers: int = 3, vocab: int = VOCAB):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    if family == "llama":
        cfg = LlamaConfig(**common, rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0})
    elif family == "qwen2":
        cfg = Qwen2Config(**common, use_sliding_window=False)
    elif family == "mistral":
        cfg = MistralConfig(**common, sliding_window=None)
    else:
        raise ValueError(family)
    return cfg


def tiny_model(family: str = "llama", rope: dict | None = None, seed: int = 0, **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, rope, **kw), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.ndim > 1 else None
    return model.eval()


def smooth_tiny_model(seed: int = 1):
    """A tiny random Llama with small weights (std 0.05): its caches vary smoothly with the content,
    so corrections learned on some questions carry over to others, as on a real model."""
    model = tiny_model("llama", seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.mul_(0.25)
    return model


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


@pytest.fixture(autouse=True)
def cells_in_this_process(monkeypatch):
    """Suites and ablations here, and those the tests start as commands (reproduce's experiments), run
    their cells in one process: ``--cell-process auto`` would start a fresh interpreter per cell on
    CPU, ~5 s each. ``--cell-process fresh`` is tested explicitly (test_cell_process.py)."""
    monkeypatch.setattr("kvcmas_bench.jobs.cells.AUTO_FRESH_ON_CPU", False)
    monkeypatch.setenv("KVCMAS_BENCH_CELL_PROCESS", "same")


@pytest.fixture(scope="session")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="session")
def engine(llama):
    from kvcmas_bench.engine import Engine

    return Engine(llama)


def run_cli(args: list[str]) -> int:
    """Run the CLI in-process; its exit code (0 when it returns normally)."""
    from kvcmas_bench.cli import main

    try:
        main(args)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def interrupt_on_call(monkeypatch, module, name: str, n: int):
    """Patch ``module.name`` to raise KeyboardInterrupt on its ``n``-th call (a user's Ctrl-C in
    the middle of a run); returns the real function so a test can restore it."""
    real = getattr(module, name)
    calls = {"n": 0}

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] == n:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(module, name, flaky)
    return real


def rand_ids(n: int, seed: int, vocab: int = VOCAB) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random-weight Llama saved with the real SmolLM2 tokenizer (fast end-to-end runs)."""
    from transformers import AutoTokenizer

    from kvcmas_bench.modeling import default_model_dir

    tok = AutoTokenizer.from_pretrained(default_model_dir())
    model = tiny_model("llama", vocab=len(tok), layers=2)
    model.config.eos_token_id = tok.eos_token_id
    d = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if a job loads a model or a serving engine."""
    import kvcmas_bench.jobs.sweep as sweep
    import kvcmas_bench.modeling as modeling

    def boom(*a, **kw):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(modeling, "load_model", boom)
    monkeypatch.setattr(sweep, "get_engine", boom)


def one_line(capsys, needle: str) -> str:
    """The one error line the CLI printed (no traceback), which must contain ``needle``."""
    err = capsys.readouterr().err
    got = [ln for ln in err.splitlines() if ln.strip()]
    assert len(got) == 1 and "Traceback" not in err, err
    assert got[0].startswith("kvcmas-bench: error: ") and needle in got[0], got[0]
    return got[0]


@pytest.fixture
def slow_method():
    """A method registered as "slow-test-method" whose planning waits for ``gate`` (a
    threading.Event, set by the test): planning that is not done yet. Unregistered afterwards."""
    import threading
    from types import SimpleNamespace

    from kvcmas_bench.methods.base import METHODS, Method

    gate = threading.Event()

    class _Slow(Method):
        name = "slow-test-method"

        def materialize(self, ctx):
            gate.wait(5)
            return ctx.dense()

    METHODS[_Slow.name] = _Slow
    yield SimpleNamespace(name=_Slow.name, gate=gate)
    gate.set()
    METHODS.pop(_Slow.name, None)
