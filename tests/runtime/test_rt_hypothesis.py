"""Property: for small random topologies, plans and routings, the layout run by the NumPy
reference executor equals the oracle, chunk by chunk in any order the waits allow."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epcc.runtime.layout import compute_layout

from rt_helpers import check_against_oracle, check_invariants, compile_text, make_inputs

TOPO = """\
schedule hyp "generated"
topology t {{
  levels node {nodes}, gpu {gpus}
  rank gpu
  relation peer = other gpu
  {far_rel}
  link nv p2p {{ connects peer  bandwidth 100 GB/s  latency 2 us }}
  {far_link}
  link hbm local {{ bandwidth 1000 GB/s }}
}}
workload {{ tokens 16 per rank  hidden 128  dtype {dtype}  topk {topk}  experts {experts} {placement} }}
"""

PLANS = {
    # one hop: every token straight to every rank that needs it
    "push": """dispatch {{
  {chunk}
  step push: send tokens for peer from input to peer.output over nv
  {far_push}
  step keep: permute input into output
}}
combine reverse of dispatch
""",
    "pull": """dispatch {{
  {chunk}
  step own: permute input into output
  step fetch: pull tokens for me from peer.input into output over nv
  {far_pull}
}}
combine reverse of dispatch
""",
    # two hops: once per far node to the same-index GPU, which forwards inside its node
    "relay": """dispatch {{
  buffer recv
  {chunk}
  step net: send tokens for rail.node from input to rail.recv over net
  step intra: send tokens for peer from input to peer.output over nv
  step keep: permute input into output
  step fwd: send tokens for peer from recv to peer.output over nv
  step keep_far: permute recv into output
}}
combine reverse of dispatch
""",
    # two hops through a row-major send buffer, the far side pulled
    "relay_pull": """dispatch {{
  buffer sendbuf
  buffer recv
  {chunk}
  step reorder: copy tokens from input into sendbuf
  step net: pull tokens for node from rail.sendbuf into recv over net
  step fwd: send tokens for peer from sendbuf, recv to peer.output over nv
  step keep: permute sendbuf, recv into output
}}
combine reverse of dispatch
""",
}


@st.composite
def cases(draw):
    plan = draw(st.sampled_from(sorted(PLANS)))
    nodes = draw(st.sampled_from([2, 3] if plan.startswith("relay") else [1, 2]))
    gpus = draw(st.integers(2, 4))
    R = nodes * gpus
    epr = draw(st.integers(1, 3))
    experts = R * epr
    topk = draw(st.integers(1, min(4, experts)))
    chunk = draw(st.sampled_from([None, 1, 2, 3, 5]))
    far = nodes > 1
    text = TOPO.format(
        nodes=nodes, gpus=gpus, dtype=draw(st.sampled_from(["bf16", "fp8"])), topk=topk, experts=experts,
        placement=draw(st.sampled_from(["blocked", "strided"])),
        far_rel=("relation rail = other node\n  relation far = other node, any gpu" if far else ""),
        far_link=("link net rdma { connects rail or far  bandwidth 50 GB/s  latency 5 us }" if far else ""),
    ) + PLANS[plan].format(
        chunk=f"defaults chunk {chunk} tokens" if chunk else "",
        far_push="step pushfar: send tokens for far from input to far.output over net" if far else "",
        far_pull="step fetchfar: pull tokens for me from far.input into output over net" if far else "",
    )
    tokens = draw(st.integers(0, 12))
    seed = draw(st.integers(0, 2 ** 16))
    empty = draw(st.sampled_from([0.0, 0.0, 0.2, 1.0]))
    skew = draw(st.sampled_from([0.0, 1.0, 3.0]))
    return text, R, tokens, topk, experts, seed, empty, skew


def random_topk(R, T, k, E, seed, empty, skew):
    """Distinct experts per token (skewed popularity), some slots -1."""
    rng = np.random.default_rng(seed)
    logw = -skew * np.log(np.arange(1, E + 1))[rng.permutation(E)]
    keys = logw[None, :] + rng.gumbel(size=(R * T, E))
    idx = np.argsort(-keys, axis=1)[:, :k]
    idx[rng.random(idx.shape) < empty] = -1
    return idx.reshape(R, T, k).astype(np.int64)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_layout_matches_the_oracle(tmp_path_factory, case):
    text, R, T, k, E, seed, empty, skew = case
    plan = compile_text(text, tmp_path_factory.getbasetemp())
    assert plan.num_ranks == R
    topk = random_topk(R, T, k, E, seed, empty, skew)
    topk, w, x = make_inputs(plan, topk_idx=topk, seed=seed)
    lay = compute_layout(plan, topk, w)
    check_invariants(plan, lay)
    check_against_oracle(plan, topk, w, x, seed=seed, layout=lay)
    check_against_oracle(plan, topk, w, x, seed=seed, chunked=True, layout=lay)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_cpu_backend_matches_the_oracle(tmp_path_factory, case):
    """The JIT-compiled CPU backend (threads per role, real waits and atomics) on random small
    topologies and skewed routings."""
    text, R, T, k, E, seed, empty, skew = case
    plan = compile_text(text, tmp_path_factory.getbasetemp())
    topk = random_topk(R, T, k, E, seed, empty, skew)
    topk, w, x = make_inputs(plan, topk_idx=topk, seed=seed)
    check_against_oracle(plan, topk, w, x, seed=seed, backend="cpu")


def token_major(text: str) -> str:
    """The generated schedule with the workload's `layout token`."""
    head, sep, rest = text.partition("workload {")
    body, close, tail = rest.partition(" }")
    assert sep and close
    return f"{head}{sep}{body}  layout token{close}{tail}"


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.booleans())
def test_token_major_layout_matches_the_oracle(tmp_path_factory, case, on_cpu):
    """`layout token` on every generated plan shape: the layout, the reference executor (whole and
    chunk by chunk) and the CPU backend equal the token-major oracle."""
    text, R, T, k, E, seed, empty, skew = case
    plan = compile_text(token_major(text), tmp_path_factory.getbasetemp())
    assert plan.workload.layout == "token"
    topk = random_topk(R, T, k, E, seed, empty, skew)
    topk, w, x = make_inputs(plan, topk_idx=topk, seed=seed)
    lay = compute_layout(plan, topk, w)
    check_invariants(plan, lay)
    if on_cpu:
        check_against_oracle(plan, topk, w, x, seed=seed, backend="cpu", layout=lay)
    else:
        check_against_oracle(plan, topk, w, x, seed=seed, layout=lay)
        check_against_oracle(plan, topk, w, x, seed=seed, chunked=True, layout=lay)


def test_every_generated_plan_shape_compiles_and_runs(tmp_path):
    for plan_name in sorted(PLANS):
        text = TOPO.format(nodes=2, gpus=3, dtype="bf16", topk=3, experts=12, placement="strided",
                           far_rel="relation rail = other node\n  relation far = other node, any gpu",
                           far_link="link net rdma { connects rail or far  bandwidth 50 GB/s  latency 5 us }") + \
            PLANS[plan_name].format(chunk="defaults chunk 2 tokens",
                                    far_push="step pushfar: send tokens for far from input to far.output over net",
                                    far_pull="step fetchfar: pull tokens for me from far.input into output over net")
        plan = compile_text(text, tmp_path)
        topk = random_topk(6, 9, 3, 12, 1, 0.1, 1.0)
        topk, w, x = make_inputs(plan, topk_idx=topk, seed=1)
        lay = check_against_oracle(plan, topk, w, x, seed=1, chunked=True)
        check_invariants(plan, lay)
        assert any(c.step == "fwd" for c in lay.copies) == plan_name.startswith("relay")
