"""Agent-graph shapes: segment structure, exactness of NonShared, every method on every shape."""

from __future__ import annotations

import pytest
import torch

from kvcmas_bench.engine import Engine
from kvcmas_bench.methods import METHODS, get_method
from kvcmas_bench.workflow import TOPOLOGIES, Workflow, plan
from kvcmas_bench.workloads import get_workload

MMLU = get_workload("mmlu")


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("agents", [2, 4, 8])
@pytest.mark.parametrize("rounds", [1, 2])
def test_plan_shapes(topology, agents, rounds):
    nodes = plan(topology, MMLU.roles, MMLU.final_role, agents, rounds)
    n_task = agents - 1
    final = nodes[-1]
    assert final.final and final.role == MMLU.final_role and sum(n.final for n in nodes) == 1
    for i, n in enumerate(nodes):
        assert all(r < i for r in n.reads)  # reads only what already ran
        assert set(n.reads) <= n.ancestors < set(range(i)) | {-1} or set(n.reads) <= n.ancestors
    if topology == "chain":
        assert len(nodes) == n_task * rounds + 1
        assert all(n.reads == list(range(i)) for i, n in enumerate(nodes))
    elif topology == "loop":
        assert len(nodes) == n_task * rounds + 1
        assert all(len(n.reads) == min(i, n_task) for i, n in enumerate(nodes[:-1]))
        assert len(final.reads) == n_task
    elif topology == "fan-out":
        width = max(n_task - 1, 1)
        assert len(nodes) == 1 + width * rounds + 1
        assert all(n.reads == [0] for n in nodes[1 : 1 + width])
        assert len(final.reads) == (width + 1 if rounds == 1 else width)
    else:
        assert len(nodes) == n_task * rounds + 1
        assert all(n.reads == [] for n in nodes[:n_task])
        assert final.reads == list(range(len(nodes) - 1 - n_task, len(nodes) - 1))


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir):
    from kvcmas_bench.modeling import load_model

    lm = load_model(tiny_model_dir, device="cpu")
    return Engine(lm.model, lm.tokenizer)


def _sample():
    return MMLU.load()[7]


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("agents,rounds", [(2, 1), (4, 2), (8, 1)])
def test_segments_and_nonshared_equal_whole_prompt_runs(tiny_engine, topology, agents, rounds):
    flow = Workflow(tiny_engine, get_method("nonshared"), MMLU, 3, 2, topology=topology, agents=agents, rounds=rounds)
    run = flow.run_sample(_sample())
    assert len(run.steps) == len(flow.nodes)
    q_ids = tiny_engine.tokenizer(_sample().query, add_special_tokens=False)["input_ids"]
    model = tiny_engine.model
    for node, step in zip(flow.nodes, run.steps):
        segs = step.request.segments
        assert segs[0].kind == "PF" and segs[-1].kind == "PF"
        assert all(a.kind != b.kind for a, b in zip(segs, segs[1:]))  # PF and PH alternate
        ph = [s for s in segs if s.kind == "PH"]
        assert ph[0].slot == "q" and ph[0].ids == q_ids
        expect = [f"out:{flow.nodes[r].id}" for r in node.reads if run.steps[r].result.output_ids]
        assert [s.slot for s in ph[1:]] == expect
        for s in ph[1:]:
            producer = next(i for i, n in enumerate(flow.nodes) if f"out:{n.id}" == s.slot)
            assert s.ids == run.steps[producer].result.output_ids
        ids = torch.tensor([step.request.prompt_ids])
        gen = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=step.request.max_new_tokens,
            pad_token_id=0,
        )
        ref = gen[0, ids.shape[1] :].tolist()
        eos = model.config.eos_token_id
        if eos in ref:
            ref = ref[: ref.index(eos)]
        assert step.result.output_ids == ref


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_every_method_runs_on_every_shape(tiny_model_dir, tmp_path, topology):
    from kvcmas_bench.jobs.run import RunOptions, run

    for name in sorted(METHODS):
        s = run(
            RunOptions(
                method=name,
                model=tiny_model_dir,
                limit=1,
                output_path=str(tmp_path / f"{topology}-{name}"),
                device="cpu",
                max_new_tokens=2,
                final_max_new_tokens=2,
                topology=topology,
                agents=4,
                rounds=2,
                calib_samples=1,
            )
        )
        assert s["n"] == 1, name
