"""config.json -> cfg.model (both transformers spellings of rope), refusals, and the exported
config.json that transformers reads back to the same model."""

from __future__ import annotations

import json

import pytest

from ftcore.config.schema import compose
from ftcore.errors import FtcoreError
from ftcore.hf.config import hf_config_dict, merge_hf_config, model_fields, read_hf_config
from tests.support.hf_helpers import ROPE, VOCAB, hf_config


@pytest.fixture
def hf_dir(tmp_path):
    hf_config().save_pretrained(str(tmp_path))
    return tmp_path


def test_merge_fills_the_model_section(hf_dir):
    cfg = merge_hf_config(compose([f"model.hf_path={hf_dir}"]))
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size) == (4, 64, 96)
    assert (m.num_attention_heads, m.num_query_groups, m.kv_channels) == (4, 2, 16)
    assert (
        m.vocab_size == VOCAB
        and m.norm_eps == 1e-5
        and m.rope_theta == 5000.0
        and not m.tie_embeddings
    )
    for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        assert m.rope_scaling[k] == ROPE[k]
    assert m.tokenizer == str(hf_dir)


def test_transformers4_spelling():
    hf = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
          "num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": 100, "rope_theta": 500000.0,
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}, "tie_word_embeddings": True}  # fmt: skip
    f = model_fields(hf)
    assert (
        f["rope_theta"] == 500000.0
        and f["rope_scaling"]["original_max_position_embeddings"] == 8192
    )
    assert f["num_query_groups"] == 1 and f["kv_channels"] == 8 and f["tie_embeddings"]
    assert model_fields({**hf, "rope_scaling": None})["rope_scaling"] is None


@pytest.mark.parametrize(
    "change,needle",
    [
        (
            {"architectures": ["GemmaForCausalLM"], "model_type": "gemma"},
            "unsupported architecture",
        ),
        (
            {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe"},
            "unsupported architecture",
        ),
        (
            {"architectures": ["MistralForCausalLM"], "num_local_experts": 8},
            "mixture of experts is not supported",
        ),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_parameters": None},
            "rope_type=yarn",
        ),
    ],
)
def test_unsupported_configs_name_the_file(hf_dir, change, needle):
    f = hf_dir / "config.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), **change}))
    with pytest.raises(FtcoreError, match=needle) as e:
        read_hf_config(str(hf_dir))
    assert str(f) in str(e.value) and "model.hf_path" in str(e.value)


def test_missing_config_json(tmp_path):
    with pytest.raises(FtcoreError, match="config.json is missing"):
        read_hf_config(str(tmp_path))
    with pytest.raises(FtcoreError, match="not a directory"):
        read_hf_config(str(tmp_path / "nope"))


def test_exported_config_reads_back(hf_dir, tmp_path):
    from transformers import AutoConfig

    cfg = merge_hf_config(compose([f"model.hf_path={hf_dir}"]))
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(hf_config_dict(cfg.model, dtype="float32")))
    back = AutoConfig.from_pretrained(str(out))
    ref = hf_config()
    for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
              "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "tie_word_embeddings"):  # fmt: skip
        assert getattr(back, k) == getattr(ref, k), k
    again = model_fields(json.loads((out / "config.json").read_text()))
    assert again == model_fields(json.loads((hf_dir / "config.json").read_text()))


def test_cli_exit_2_without_config_json(tmp_path):
    from ftcore.cli import main
    from ftcore.eval import task

    assert main("eval", task, [f"model.hf_path={tmp_path}"]) == 2


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_families_read_and_export_as_themselves(family, tmp_path):
    """Each family's config.json gives its model.family (and Qwen3 its head dim apart from
    hidden / heads); the exported config.json is that architecture again, same shapes."""
    from transformers import AutoConfig

    src = tmp_path / "src"
    hf_config(family=family).save_pretrained(str(src))
    cfg = merge_hf_config(compose([f"model.hf_path={src}"]))
    assert cfg.model.family == family
    assert cfg.model.kv_channels == (32 if family == "qwen3" else 16)
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(hf_config_dict(cfg.model, dtype="float32")))
    back, ref = AutoConfig.from_pretrained(str(out)), AutoConfig.from_pretrained(str(src))
    arch = {
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "mistral": "MistralForCausalLM",
    }
    assert type(back) is type(ref) and back.architectures == [arch[family]]
    for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
              "num_key_value_heads", "vocab_size", "rms_norm_eps", "tie_word_embeddings"):  # fmt: skip
        assert getattr(back, k) == getattr(ref, k), k
    assert model_fields(json.loads((out / "config.json").read_text())) == model_fields(
        json.loads((src / "config.json").read_text())
    )


@pytest.mark.parametrize(
    "family,change,seq_len,refused",
    [
        (
            "qwen2",
            {"use_sliding_window": False, "sliding_window": 8},
            32,
            False,
        ),  # key, switched off
        # transformers 4 configs (no layer_types): the switch, from layer max_window_layers on
        (
            "qwen2",
            {
                "use_sliding_window": True,
                "sliding_window": 8,
                "max_window_layers": 0,
                "layer_types": None,
            },
            32,
            True,
        ),
        (
            "qwen2",
            {
                "use_sliding_window": True,
                "sliding_window": 8,
                "max_window_layers": 4,
                "layer_types": None,
            },
            32,
            False,
        ),  # no layer from max_window_layers on
        (
            "qwen2",
            {
                "use_sliding_window": True,
                "sliding_window": 64,
                "max_window_layers": 0,
                "layer_types": None,
            },
            32,
            False,
        ),  # longer than the sequence
        # transformers 5: layer_types decide
        (
            "qwen3",
            {"layer_types": ["full_attention", "sliding_attention"] * 2, "sliding_window": 8},
            32,
            True,
        ),
        ("mistral", {"sliding_window": 16}, 32, True),  # Mistral v0.1: on whenever set
        ("mistral", {"sliding_window": 32}, 32, False),  # window = seq_len masks nothing
        ("mistral", {"sliding_window": None}, 32, False),  # Mistral Large 2: full attention
        (
            "llama",
            {"layer_types": ["full_attention"] * 3 + ["sliding_attention"], "sliding_window": 4},
            32,
            True,
        ),
    ],
)
def test_sliding_window_refused_when_on_and_shorter(family, change, seq_len, refused, tmp_path):
    conf = hf_config(family=family).to_dict()
    conf.update(change)
    (tmp_path / "config.json").write_text(json.dumps(conf))
    cfg = compose([f"model.hf_path={tmp_path}", f"data.seq_len={seq_len}"])
    if not refused:
        merge_hf_config(cfg)
        return
    with pytest.raises(FtcoreError, match="sliding-window attention") as e:
        merge_hf_config(cfg)
    assert e.value.field == "data.seq_len" and "data.seq_len <=" in str(e.value)


def test_family_of_a_model_section_without_hf_path():
    """conf/model files name their family; an unknown one is refused at the config checks."""
    from ftcore.validation.checks import check_choices

    assert compose(["model=qwen3_32b"]).model.family == "qwen3"
    with pytest.raises(FtcoreError) as e:
        check_choices(compose(["model.family=gemma"]))
    assert e.value.field == "model.family"
