"""Context parallelism in the planner (ftcore/planner/cp.py): the long-context experiment fits with
cp > 1, each KV exchange is priced from its bytes, attention work splits over the CP ranks, and
the layout search proposes only CP layouts validation accepts."""

from __future__ import annotations

import json

import pytest

from ftcore import planner
from ftcore.config.schema import compose
from ftcore.planner import activations as act
from ftcore.planner import calibration, cp, flops, memory, search, throughput
from ftcore.planner.view import replace, view
from ftcore.validation import checks
from tests.unit.planner.test_plan import plan_cli

LONG = ["+exp=70b_lora_128k"]


@pytest.fixture(scope="module")
def base():
    return view(compose(LONG))


def _shape(cfg, **parallel) -> act.Shape:
    data = {"seq_len": parallel.pop("seq_len")} if "seq_len" in parallel else {}
    return act.shape_of(replace(cfg, parallel=parallel, data=data))


def test_70b_lora_128k_fits_with_context_parallelism_as_typed():
    """Issue 26: `python -m ftcore.plan +exp=70b_lora_128k` fits at seq_len 131072 with cp > 1,
    on the fewest GPUs the planner finds for it, and none fits on half as many."""
    r = plan_cli(*LONG, "plan.format=json")
    assert r.returncode == 0, r.stderr[-2000:]
    p = json.loads(r.stdout)
    lay = p["layout"]
    assert p["fits"] and lay["cp"] > 1 and lay["seq_len"] == 131072 and lay["cp_comm_type"] == "p2p"
    assert p["gpus_needed"] == p["num_gpus"] == 4 and p["cluster"] == "b200"
    half = replace(view(compose(LONG)), cluster={"num_gpus": 2})
    assert not any(search.fits(search._with(half, **lay), 2)[0] for lay in search.layouts(half, 2))


def test_te_saves_only_the_local_chunk_and_cpu_the_gathered_kv(base):
    """On GPU (TE) a CP rank saves what a rank without CP saves for seq_len/cp tokens; the CPU's
    all-gather attention saves K and V of the whole sequence per layer beside its own queries."""
    short = _shape(base, cp=1, seq_len=32768)
    for comm in cp.COMM_TYPES[:3]:
        assert act.layer_parts(_shape(base, cp=4, cp_comm_type=comm)) == act.layer_parts(short)
    sh = act.shape_of(compose(["+exp=tiny_full", "parallel.cp=2", "parallel.cp_comm_type=a2a"]))
    assert (sh.impl, sh.cp_comm) == ("local", "all_gather")  # the CPU's one CP attention
    kv_whole = sh.b * sh.s * 2 * sh.kv * sh.ab
    q_local = sh.tokens * sh.q * sh.ab
    assert act.layer_parts(sh)["core_attn"] == q_local + kv_whole + act._sdpa(sh)


def test_transient_kv_buffers_by_comm_type(base):
    """TE allocates the exchanged K/V beside the saved activations while a layer's attention
    runs: all_gather the whole sequence's (gathered, reordered, dK/dV), p2p every received chunk
    and partial output; the stage's total counts them with a recomputed layer."""
    sizes = {c: cp.transient_bytes(_shape(base, cp_comm_type=c)) for c in cp.COMM_TYPES}
    sh = act.shape_of(base)
    kv, out = cp.kv_bytes(sh), sh.tokens * sh.q // sh.tp * sh.ab
    assert sizes["all_gather"] == 3 * sh.cp * kv
    assert sizes["p2p"] == max(sh.cp * (kv + out), 4 * kv + out)
    assert sizes["a2a"] > 0 and cp.transient_bytes(_shape(base, cp=1)) == 0
    st = memory.stage_memory(base, 4, 0)
    assert st.parts["cp_transient"] == sizes["p2p"]
    assert st.activations == (
        st.parts["saved_activations"]
        + max(st.parts["loss_activations"] + st.parts["logits_transient"],
              st.parts["recompute_transient"] + sizes["p2p"])
    )  # fmt: skip


def test_attention_splits_over_cp_ranks_and_dominates_at_128k(base):
    """Causal attention over the whole sequence, 1/cp of it per rank (load-balanced chunks); at
    131072 tokens it is most of a LoRA step's executed work, though LoRA's model FLOPs (4N', the
    published convention) leave it out."""
    one = flops.attention_forward_flops(replace(base, parallel={"cp": 1}))
    for c in (2, 4, 8):
        assert flops.attention_forward_flops(replace(base, parallel={"cp": c})) * c == one
    w = flops.micro_batch_work(base, 0)
    assert w.attention > w.gemm_base + w.gemm_quant


def _exposed(base, cluster: dict | None = None, **parallel) -> float:
    data = {"seq_len": parallel.pop("seq_len")} if "seq_len" in parallel else {}
    cfg = replace(base, parallel=parallel, data=data, cluster=cluster or {})
    sh = act.shape_of(cfg)
    rate = throughput._peak(cfg, "bf16") * calibration.of(cfg.cluster).attention_efficiency
    fwd = flops.attention_forward_flops(cfg) / rate
    return cp.exposed_s(sh, (fwd, 2.5 * fwd), lambda span: throughput._link(cfg, span), False)


def test_kv_exchange_priced_by_comm_type(base):
    """p2p is hidden behind attention at 128k even over the network and exposed once the blocks
    are short; all_gather's gathers and reduce-scatter are never hidden, (cp - 1) K/V each; a2a
    moves q, k, v and the output both ways."""
    net = {"nvlink_domain": 1}  # every CP group over the network
    assert _exposed(base) == 0.0 and _exposed(base, net) == 0.0
    assert _exposed(base, net, seq_len=2048) > 0
    sh = act.shape_of(base)
    bw = throughput._link(base, sh.tp * sh.cp)
    assert _exposed(base, cp_comm_type="all_gather") == pytest.approx(
        3 * (sh.cp - 1) * cp.kv_bytes(sh) / bw
    )
    vol = (sh.cp - 1) / sh.cp * sh.tokens * (2 * sh.q + 2 * sh.kv) / sh.tp * sh.ab
    assert _exposed(base, cp_comm_type="a2a") == pytest.approx(2 * vol / bw)


def test_search_proposes_only_cp_layouts_validation_accepts(base):
    """Every searched layout passes validation/checks.py's sequence checks (the same rules,
    planner/cp.py): seq_len a multiple of tp*2*cp under sp, a2a only where heads divide (on
    unpacked rows: packed ones take p2p only, test_packed_rows_under_te_take_p2p_only)."""
    cfg = replace(base, cluster={"gpus_per_node": 8}, data={"packing": False})
    seen = set()
    for lay in search.layouts(cfg, 16, vary_recompute=False):
        c = search._with(cfg, **lay)
        checks.check_sequence(c)
        if lay["cp"] > 1:
            seen.add((lay["tp"], lay["cp"], lay["cp_comm_type"]))
    assert (2, 8, "p2p") in seen and (2, 8, "a2a") not in seen  # 4 kv groups per TP rank
    assert (2, 4, "a2a") in seen and (1, 16, "all_gather") in seen
    short = replace(cfg, data={"seq_len": 48})  # tp=4 under sp and cp=4 cut it 32 ways: no
    pairs = set()
    for lay in search.layouts(short, 16, vary_recompute=False):
        checks.check_sequence(search._with(short, **lay))
        pairs.add((lay["tp"], lay["cp"]))
    assert (2, 4) in pairs and (4, 4) not in pairs and (4, 1) in pairs


def test_search_rows_select_their_comm_type(base):
    """A searched CP row's overrides name its cp_comm_type and reproduce its speed."""
    rows = search.search(base, 4, top=3)
    assert rows and all("parallel.cp_comm_type=" in r["overrides"] for r in rows if r["cp"] > 1)
    r = next(r for r in rows if r["cp"] > 1)
    p = planner.plan(compose([*LONG, *r["overrides"].split()]), 4)
    assert p["tokens_per_s_per_gpu"] == pytest.approx(r["tokens_per_s_per_gpu"], rel=1e-9)


@pytest.mark.parametrize("comm", ["all_gather", "a2a", "a2a+p2p"])
def test_packed_rows_under_te_take_p2p_only(comm):
    """Issue 41, item 3 (TE 2.9's rule, planner/cp.py THD_COMM_TYPES): packed rows on a GPU with
    TE layers are refused for every comm type but p2p; unpacked rows and the CPU runtime keep them
    all (local layers on a GPU ignore them: test_local_layers_on_a_gpu_take_no_comm_type)."""
    hier = ["parallel.hierarchical_cp_sizes=[2,1]"] if comm == "a2a+p2p" else []
    over = [*LONG, "model.allow_random_base=true", *hier]
    with pytest.raises(checks.FtcoreError) as e:
        checks.check_sequence(compose([*over, f"parallel.cp_comm_type={comm}"]))
    assert e.value.field == "parallel.cp_comm_type" and "p2p" in e.value.fix
    checks.check_sequence(compose([*LONG, "parallel.cp_comm_type=p2p"]))
    for ok in (["data.packing=false"], ["cluster=local_cpu"]):
        checks.check_sequence(compose([*over, f"parallel.cp_comm_type={comm}", *ok]))
    comms = {r.get("cp_comm_type") for r in search.layouts(compose(LONG), 8) if r["cp"] > 1}
    assert comms == {"p2p"}, comms  # the layout search applies the same rule


@pytest.mark.parametrize("comm", ["all_gather", "a2a"])
def test_local_layers_on_a_gpu_take_no_comm_type(comm):
    """Issue 50 item 13: megatron's local layers (precision.te_layers=false, QLoRA) attend under CP
    with ftcore's own all-gather whatever parallel.cp_comm_type says; the layout search proposed
    all_gather and a2a for qwen3_235b_a22b_lora (then on local layers) and validation took them.
    Now refused on a GPU cluster (packed rows or not), kept on the CPU runtime and with TE."""
    over = [*LONG, "model.allow_random_base=true", "data.packing=false",
            f"parallel.cp_comm_type={comm}"]  # fmt: skip
    checks.check_sequence(compose(over))  # TE's attention takes it on unpacked rows
    for local in (["precision.te_layers=false"], ["peft=qlora"]):
        with pytest.raises(checks.FtcoreError) as e:
            checks.check_sequence(compose([*over, *local]))
        assert e.value.field == "parallel.cp_comm_type" and "p2p" in e.value.fix
    checks.check_sequence(compose([*over, "precision.te_layers=false", "cluster=local_cpu"]))


def test_qwen3_moe_lora_searches_and_takes_p2p_only():
    """The layout search's CP rows for qwen3_235b_a22b_lora (TE's layers now, packed rows: p2p
    only), and with precision.te_layers=false (local layers: the default only); the row it used
    to propose is refused."""
    for extra in ([], ["precision.te_layers=false"]):  # TE's packed rows, or local layers
        cfg = compose(["+exp=qwen3_235b_a22b_lora", *extra])
        rows = [r for r in search.layouts(cfg, 16, vary_recompute=False) if r["cp"] > 1]
        assert rows and {r["cp_comm_type"] for r in rows} == {"p2p"}, extra
        # the row it proposed, as `FTCORE_DRY_RUN=1 bash slurm/qwen3_235b_a22b_lora.sh ...` checks it
        proposed = ["parallel.pp=1", "parallel.cp=4", "parallel.cp_comm_type=all_gather"]
        with pytest.raises(checks.FtcoreError, match="p2p"):
            checks.check_sequence(compose(["+exp=qwen3_235b_a22b_lora", *extra, *proposed]))
