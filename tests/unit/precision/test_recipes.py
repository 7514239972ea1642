"""Precision recipes on CPU: config -> TransformerConfig fields and TE recipes, the checks, and the
CPU behaviour of the GPU-only helpers. megatron-core's own TransformerConfig is the oracle that the
mapped fields are accepted and mean what ftcore says."""

from __future__ import annotations

import pytest
import torch
from megatron.core.fp8_utils import is_first_last_bf16_layer
from megatron.core.transformer import TransformerConfig
from omegaconf import OmegaConf

from ftcore.config.schema import compose
from ftcore.errors import FtcoreError
from ftcore.precision import hardware, recipes

OPTIONS = ["fp32", "bf16", "fp8_delayed", "fp8_cs", "fp8_blockwise", "mxfp8", "nvfp4"]
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def configs():
    """Every precision option composed on the tiny run (composing is the slow part: once)."""
    return {name: compose(["+exp=tiny_full", f"precision={name}"]) for name in OPTIONS}


def with_(cfg, **dotted):
    """A copy of cfg with dotted keys overridden."""
    cfg = OmegaConf.create(OmegaConf.to_container(cfg))
    for key, value in dotted.items():
        OmegaConf.update(cfg, key.replace("__", "."), value, merge=False)
    return cfg


# Expected precision fields of TransformerConfig, option by option (keys absent: megatron default).
COMMON_OFF = dict(fp16=False, fp8=None, fp8_param=False, fp4=None, fp4_param=False,
                  fp8_dot_product_attention=False, first_last_layers_bf16=False,
                  num_layers_at_start_in_bf16=0, num_layers_at_end_in_bf16=0)  # fmt: skip
FP8_DEFAULTS = dict(fp8_margin=0, fp8_amax_history_len=1024, fp8_amax_compute_algo="max")
EXPECTED = {
    "fp32": dict(COMMON_OFF, params_dtype=torch.float32, pipeline_dtype=torch.float32, bf16=False),
    "bf16": dict(COMMON_OFF, params_dtype=BF16, pipeline_dtype=BF16, bf16=True),
    "fp8_delayed": dict(COMMON_OFF, params_dtype=BF16, pipeline_dtype=BF16, bf16=True,
                        fp8="hybrid", fp8_recipe="delayed", **FP8_DEFAULTS),
    "fp8_cs": dict(COMMON_OFF, params_dtype=BF16, pipeline_dtype=BF16, bf16=True,
                   fp8="hybrid", fp8_recipe="tensorwise", **FP8_DEFAULTS),
    "fp8_blockwise": dict(COMMON_OFF, params_dtype=BF16, pipeline_dtype=BF16, bf16=True,
                          fp8="e4m3", fp8_recipe="blockwise", **FP8_DEFAULTS),
    "mxfp8": dict(COMMON_OFF, params_dtype=BF16, pipeline_dtype=BF16, bf16=True,
                  fp8="e4m3", fp8_recipe="mxfp8", **FP8_DEFAULTS),
    "nvfp4": dict(COMMON_OFF, params_dtype=BF16, pipeline_dtype=BF16, bf16=True,
                  fp4="e2m1", fp4_recipe="nvfp4", first_last_layers_bf16=True,
                  num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=1),
}  # fmt: skip


def tiny_tc(cfg, **extra) -> TransformerConfig:
    """megatron's TransformerConfig for the tiny model with ftcore's precision fields."""
    m = cfg.model
    kw = dict(num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
              num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups,
              use_cpu_initialization=True)  # fmt: skip
    kw.update(recipes.transformer_config_kwargs(cfg))
    kw.update(extra)
    return TransformerConfig(**kw)


@pytest.mark.parametrize("name", OPTIONS)
def test_transformer_config_kwargs_field_by_field(configs, name):
    kw = recipes.transformer_config_kwargs(configs[name])
    assert kw == EXPECTED[name]


@pytest.mark.parametrize("name", OPTIONS)
def test_megatron_accepts_the_fields(configs, name):
    tc = tiny_tc(configs[name])
    for key, value in EXPECTED[name].items():
        assert getattr(tc, key) == value, key


def test_options_map_onto_megatron_and_te_names(configs):
    for name in OPTIONS:
        cfg = configs[name]
        recipes.check_config(cfg)  # every shipped option is valid on the tiny run
        r = recipes.recipe_name(cfg)
        assert recipes.is_quantized(cfg) == (r is not None)
    assert recipes.recipe_name(configs["fp8_cs"]) == "tensorwise"
    assert recipes.recipe_name(configs["nvfp4"]) == "nvfp4"


def test_fp8_options_override_each_field(configs):
    cfg = with_(configs["fp8_delayed"], precision__fp8_format="e4m3", precision__fp8_margin=1,
                precision__fp8_amax_history_len=16, precision__fp8_amax_compute_algo="most_recent",
                precision__fp8_attention=True, precision__fp8_param_gather=True)  # fmt: skip
    kw = recipes.transformer_config_kwargs(cfg)
    assert (kw["fp8"], kw["fp8_margin"], kw["fp8_amax_history_len"]) == ("e4m3", 1, 16)
    assert kw["fp8_amax_compute_algo"] == "most_recent"
    assert kw["fp8_dot_product_attention"] is True and kw["fp8_param"] is True
    assert recipes.ddp_config_kwargs(cfg) == {"fp8_param_gather": True}
    tc = tiny_tc(cfg)
    assert tc.fp8_param and tc.fp8_dot_product_attention

    cfg = with_(configs["fp8_cs"], precision__first_last_bf16_layers=1)
    kw = recipes.transformer_config_kwargs(cfg)
    assert kw["first_last_layers_bf16"] and kw["num_layers_at_start_in_bf16"] == 1
    cfg = with_(configs["nvfp4"], precision__fp8_param_gather=True)
    assert recipes.transformer_config_kwargs(cfg)["fp4_param"] is True
    assert recipes.ddp_config_kwargs(cfg) == {"fp8_param_gather": True}
    assert recipes.ddp_config_kwargs(configs["bf16"]) == {"fp8_param_gather": False}


@pytest.mark.parametrize("name", ["fp8_cs", "nvfp4"])
def test_first_last_bf16_layers_as_megatron_reads_them(configs, name):
    cfg = with_(configs[name], precision__first_last_bf16_layers=1)
    tc = tiny_tc(cfg)
    bf16_layers = [i for i in range(tc.num_layers) if is_first_last_bf16_layer(tc, i)]
    assert bf16_layers == [0, tc.num_layers - 1]


EXPECTED_RECIPES = {
    "fp32": None,
    "bf16": None,
    "fp8_delayed": ("DelayedScaling", dict(fp8_format="HYBRID", margin=0, amax_history_len=1024,
                                           amax_compute_algo="max", fp8_dpa=False)),
    "fp8_cs": ("Float8CurrentScaling", dict(fp8_format="HYBRID", fp8_dpa=False)),
    "fp8_blockwise": ("Float8BlockScaling", dict(fp8_format="E4M3")),
    "mxfp8": ("MXFP8BlockScaling", dict(fp8_format="E4M3")),
    "nvfp4": ("NVFP4BlockScaling", {}),
}  # fmt: skip


@pytest.mark.parametrize("name", OPTIONS)
def test_te_recipe_spec(configs, name):
    assert recipes.te_recipe_spec(configs[name]) == EXPECTED_RECIPES[name]


def test_te_recipe_is_none_without_quantization(configs):
    assert recipes.te_recipe(configs["bf16"]) is None  # never touches TE


BAD = [
    ("fp8_cs", dict(precision__fp4_recipe="nvfp4"), "precision", "not both"),
    ("fp8_cs", dict(precision__fp8_recipe="fp8"), "precision.fp8_recipe", "not one of"),
    ("nvfp4", dict(precision__fp4_recipe="mxfp4"), "precision.fp4_recipe", "not nvfp4"),
    ("fp8_cs", dict(precision__fp8_format="e5m2"), "precision.fp8_format", "not one of"),
    ("fp8_delayed", dict(precision__fp8_amax_compute_algo="mean"), "precision.fp8_amax_compute_algo", "not one of"),
    ("fp8_cs", dict(precision__params_dtype="fp32"), "precision.params_dtype", "BF16"),
    ("bf16", dict(precision__params_dtype="fp16"), "precision.params_dtype", "not one of"),
    ("bf16", dict(precision__fp8_param_gather=True), "precision.fp8_param_gather", "no FP8/FP4"),
    ("bf16", dict(precision__fp8_attention=True), "precision.fp8_attention", "no FP8/FP4"),
    ("fp32", dict(precision__first_last_bf16_layers=1), "precision.first_last_bf16_layers", "no FP8/FP4"),
    ("fp8_delayed", dict(precision__first_last_bf16_layers=1), "precision.first_last_bf16_layers", "delayed"),
    ("fp8_cs", dict(precision__first_last_bf16_layers=2), "precision.first_last_bf16_layers", "leave none"),
    ("fp8_cs", dict(precision__first_last_bf16_layers=-1), "precision.first_last_bf16_layers", ">= 0"),
    ("nvfp4", dict(model__num_layers=16, parallel__pp=8, precision__first_last_bf16_layers=3), "precision.first_last_bf16_layers", "pipeline stage"),
    ("mxfp8", dict(precision__fp8_attention=True), "precision.fp8_attention", "delayed or tensorwise"),
    ("fp8_cs", dict(precision__te_layers=False), "precision.te_layers", "Transformer Engine"),
    ("fp8_cs", dict(model__hidden_size=200), "precision", "multiple of 16"),
    ("mxfp8", dict(model__ffn_hidden_size=688), "precision", "multiple of 32"),
    ("nvfp4", dict(data__seq_len=100, train__micro_batch_size=1), "data.seq_len", "multiple of 32"),
]  # fmt: skip


@pytest.mark.parametrize("name,over,field,words", BAD)
def test_check_config_refuses(configs, name, over, field, words):
    with pytest.raises(FtcoreError) as e:
        recipes.check_config(with_(configs[name], **over))
    assert e.value.field == field and words in str(e.value)


def test_megatron_agrees_delayed_scaling_cannot_keep_bf16_layers(configs):
    """The rule check_config enforces is megatron's own (it would raise later, less clearly)."""
    cfg = with_(configs["fp8_delayed"], precision__first_last_bf16_layers=1)
    with pytest.raises(ValueError, match="Delayed scaling"):
        tiny_tc(cfg)


@pytest.mark.parametrize("name", ["fp8_delayed", "fp8_cs", "fp8_blockwise", "mxfp8", "nvfp4"])
def test_check_hardware_on_cpu_names_needs_and_fallback(configs, name):
    if torch.cuda.is_available():
        pytest.skip("tests the CPU message")
    with pytest.raises(FtcoreError) as e:
        hardware.check_hardware(configs[name])
    msg = str(e.value)
    assert e.value.field == "precision"
    assert "compute capability" in msg and "no CUDA device" in msg
    assert "precision=bf16 or precision=fp32" in msg


@pytest.mark.parametrize("name", ["fp32", "bf16"])
def test_check_hardware_passes_fp32_bf16_on_cpu(configs, name):
    hardware.check_hardware(configs[name])


def test_qlora_with_fp8_is_refused(configs):
    cfg = with_(configs["fp8_cs"], peft__name="qlora")
    with pytest.raises(FtcoreError, match="NF4") as e:
        hardware.check_hardware(cfg)
    assert e.value.field == "precision" and "peft=lora" in str(e.value)
    hardware.check_hardware(with_(configs["bf16"], peft__name="qlora"))


# (recipe, compute capability, CUDA toolkit) -> runs?
SUPPORT = [
    ("delayed", 8.0, 12.4, False),  # A100
    ("delayed", 8.9, 12.4, True),  # L40S / RTX 4090
    ("tensorwise", 9.0, 12.4, True),  # H100
    ("blockwise", 8.9, 12.9, False),
    ("blockwise", 9.0, 12.4, False),  # needs CUDA 12.9
    ("blockwise", 9.0, 12.9, True),
    ("mxfp8", 9.0, 12.9, False),  # Hopper has no MX formats
    ("mxfp8", 10.0, 12.9, True),  # B200
    ("mxfp8", 10.3, 12.9, True),  # GB300
    ("mxfp8", 12.0, 12.9, False),  # RTX 50xx: TE has no MXFP8 for all GEMM layouts there
    ("nvfp4", 9.0, 12.9, False),
    ("nvfp4", 10.0, 12.9, True),
    ("nvfp4", 12.0, 12.9, True),
]


@pytest.mark.parametrize("recipe,cc,cuda,ok", SUPPORT)
def test_supported_on(recipe, cc, cuda, ok):
    runs, why = hardware.supported_on(recipe, cc, cuda)
    assert runs == ok
    assert (why == "") == ok


@pytest.mark.parametrize(
    "exclude,cc,cuda,expected",
    [("mxfp8", 9.0, 12.9, "fp8_cs"), ("nvfp4", 9.0, 12.4, "fp8_cs"), ("fp8_cs", 8.0, 12.4, "bf16"),
     ("fp8_cs", 7.0, 12.4, "fp32"), ("fp8_cs", 9.0, 12.4, "fp8_delayed"), ("fp8_cs", None, None, "bf16 or fp32")],
)  # fmt: skip
def test_fallback(exclude, cc, cuda, expected):
    assert hardware.fallback(cc, exclude, cuda) == expected


def test_check_hardware_on_a_gpu_lacking_the_recipe(configs, monkeypatch):
    """The decision path on a (pretended) H100: MXFP8 is refused and FP8 current scaling offered;
    FP8 itself passes the capability check and then needs Transformer Engine (absent here)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(hardware, "te_module", lambda: None)
    gpu = {"cluster__device": "cuda"}
    with pytest.raises(FtcoreError, match="compute capability 10.x") as e:
        hardware.check_hardware(with_(configs["mxfp8"], **gpu))
    assert "9.0" in str(e.value) and e.value.fix == "use precision=fp8_cs on this GPU"
    with pytest.raises(FtcoreError, match="Transformer Engine, which is not installed"):
        hardware.check_hardware(with_(configs["fp8_cs"], **gpu))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 0))
    with pytest.raises(FtcoreError, match="BF16 needs compute capability"):
        hardware.check_hardware(with_(configs["bf16"], **gpu))


def test_te_version_gate(configs, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 0))
    monkeypatch.setattr(hardware, "te_version", lambda: "2.5.0")
    with pytest.raises(FtcoreError, match=r"Transformer Engine >= 2.7.0.dev0; 2.5.0") as e:
        hardware.check_hardware(with_(configs["nvfp4"], cluster__device="cuda"))
    assert "precision=fp8_cs" in e.value.fix
    monkeypatch.setattr(hardware, "te_version", lambda: "2.8.0+abc123")
    monkeypatch.setattr(hardware, "te_supports", lambda name: (True, ""))
    hardware.check_hardware(with_(configs["nvfp4"], cluster__device="cuda"))


def test_cpu_paths_use_local_spec_and_no_te(configs):
    cfg = configs["fp8_cs"]
    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    assert not recipes.use_te(cfg) and recipes.layer_spec(cfg) is None
    assert not recipes.use_te(with_(cfg, cluster__device="cuda"))
    assert recipes.te_version() is None
    x = torch.randn(3, 4)
    assert recipes.high_precision(x) is x


def test_adapter_autocast_off_is_a_transparent_noop_without_te(configs):
    lin = torch.nn.Linear(4, 2)
    x = torch.randn(3, 4)
    with recipes.adapter_autocast_off():
        y = lin(x)
    with recipes.autocast(configs["fp8_cs"]):
        y2 = lin(x)
    torch.testing.assert_close(y, y2)
    y.sum().backward()
    assert lin.weight.grad is not None


@pytest.mark.parametrize("name", OPTIONS)
def test_check_merge(configs, name):
    cfg = configs[name]
    if not recipes.is_quantized(cfg):
        recipes.check_merge(cfg)
        return
    with pytest.raises(FtcoreError, match="round away") as e:
        recipes.check_merge(cfg)
    assert e.value.field == "export.merge" and "export.merge=false" in e.value.fix


def test_merge_refusal_reason_holds_in_fp8():
    """Why check_merge refuses: a typical LoRA update (|BA| ~ 1e-4 against weights ~ 2e-2) mostly
    vanishes when the merged weight is cast to FP8 E4M3, while BF16 keeps most of it."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 256, generator=g) * 0.02
    delta = torch.randn(256, 256, generator=g) * 1e-4
    lost_fp8 = (
        ((w + delta).to(torch.float8_e4m3fn).float() == w.to(torch.float8_e4m3fn).float())
        .float()
        .mean()
    )
    lost_bf16 = ((w + delta).to(BF16).float() == w.to(BF16).float()).float().mean()
    assert lost_fp8 > 0.8 and lost_bf16 < 0.5


def test_cluster_supports(configs):
    assert hardware.cluster_supports(configs["bf16"]) == (True, "")
    ok, why = hardware.cluster_supports(configs["fp8_cs"])  # local_cpu
    assert not ok and "compute capability >= 8.9" in why
    h100 = dict(cluster__device="cuda", cluster__compute_capability=9.0)
    assert hardware.cluster_supports(with_(configs["fp8_cs"], **h100))[0]
    assert not hardware.cluster_supports(with_(configs["nvfp4"], **h100))[0]
    b200 = dict(cluster__device="cuda", cluster__compute_capability=10.0)
    assert hardware.cluster_supports(with_(configs["nvfp4"], **b200))[0]


def test_export_refuses_merging_into_an_fp8_trained_base(configs, tmp_path):
    export = pytest.importorskip("ftcore.export")
    cfg = with_(configs["bf16"], export__merge=True)
    with pytest.raises(FtcoreError, match="round away") as e:
        export.merge_transform(cfg, with_(configs["fp8_cs"], peft__name="lora"), tmp_path)
    assert e.value.field == "export.merge"
