"""plait.spec.load: presets, plait files, Hugging Face config.json, units, and the errors users see."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.errors import ConfigError
from plait.spec import ClusterSpec, ModelSpec, TrainSpec
from plait.spec.clusters import CLUSTER_PRESETS
from plait.spec.load import (
    closest_first, load_cluster, load_model, load_train, model_from_hf_config, parse_bandwidth, parse_bytes,
    parse_flops, parse_seconds,
)
from plait.spec.models import MODEL_PRESETS

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


# ---- presets --------------------------------------------------------------------------------
def test_every_preset_loads_by_name():
    for name, spec in MODEL_PRESETS.items():
        assert load_model(name) is spec
    for name, spec in CLUSTER_PRESETS.items():
        assert load_cluster(name) is spec


def test_preset_names_are_case_insensitive():
    assert load_model("GPT3-175B") is MODEL_PRESETS["gpt3-175b"]


@pytest.mark.parametrize("name, params_b", [
    ("gpt-1.7b", 1.7), ("gpt-3.6b", 3.6), ("gpt-7.5b", 7.5), ("gpt-18.4b", 18.4), ("gpt-39.1b", 39.1),
    ("gpt-76.1b", 76.1), ("gpt-145.6b", 145.6), ("gpt-310.1b", 310.1), ("gpt-529.6b", 529.6), ("gpt-1t", 1008.0),
])
def test_gpt_presets_match_published_parameter_counts(name, params_b):
    spec = MODEL_PRESETS[name]
    L, h, V, s = spec.num_layers, spec.hidden_size, spec.vocab_size, spec.max_seq_len
    paper = 12 * L * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * L * h))  # Narayanan et al., tied embeddings
    final_norm = 2 * h  # the formula leaves out the final LayerNorm
    assert spec.num_params == pytest.approx(paper + final_norm, rel=1e-12)
    assert spec.num_params / 1e9 == pytest.approx(params_b, abs=0.06 * params_b)  # the table's rounded sizes


@pytest.mark.parametrize("name, params", [
    ("llama2-7b", 6_738_415_616), ("llama2-13b", 13_015_864_320), ("llama2-70b", 68_976_648_192),
    ("llama3-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496),
])
def test_llama_presets_match_hugging_face_parameter_counts(name, params):
    assert MODEL_PRESETS[name].num_params == params


def test_unknown_preset_lists_closest_first():
    with pytest.raises(ConfigError) as e:
        load_model("llama3-7b")
    message = str(e.value)
    assert "'llama3-7b'" in message and "did you mean" in message
    listed = message.split("presets: ")[1]
    assert listed.index("llama3-8b") < listed.index("gpt-1.7b")
    assert "\n" not in message


def test_unknown_cluster_names_presets():
    with pytest.raises(ConfigError, match=r"unknown cluster 'a100'.*a100-80g"):
        load_cluster("a100")


def test_closest_first_keeps_every_choice():
    choices = ["alpha", "beta", "gamma"]
    assert sorted(closest_first("gama", choices)) == sorted(choices)
    assert closest_first("gama", choices)[0] == "gamma"


# ---- Hugging Face config.json ---------------------------------------------------------------
def test_llama2_config_matches_preset():
    spec = load_model(EXAMPLES / "hf/llama-2-7b/config.json")
    preset = MODEL_PRESETS["llama2-7b"]
    assert spec.arch == "llama" and spec.name == "Llama-2-7b-hf"
    assert spec.source == "hf:" + str((EXAMPLES / "hf/llama-2-7b").resolve())  # the executor runs the HF class
    # the shapes are the preset's; the blocks are measured from the class on meta (plait.hf.spec)
    assert spec.replace(name=preset.name, source="plait", blocks=(), pre_params=None, post_params=None,
                        tp_plan={}) == preset
    assert spec.num_params == pytest.approx(preset.num_params, rel=1e-3)


def test_mistral_config_gqa_and_context():
    spec = load_model(str(EXAMPLES / "hf/mistral-7b"))  # a directory holding config.json works too
    assert (spec.arch, spec.num_kv_heads, spec.ffn_hidden_size, spec.max_seq_len) == ("llama", 8, 14336, 32768)
    assert spec.num_params == pytest.approx(7.24e9, rel=0.01)  # Mistral-7B-v0.1


def test_qwen2_config_tied_and_rope():
    spec = load_model(EXAMPLES / "hf/qwen2-0.5b/config.json")
    assert spec.tied_embeddings and spec.rope_theta == 1e6 and spec.norm_eps == 1e-6
    assert (spec.num_heads, spec.num_kv_heads, spec.vocab_size) == (14, 2, 151936)
    assert spec.bias == "qkv"  # Qwen2's q/k/v projections have biases, o_proj and the MLP none
    assert spec.num_params == 494_032_768  # Qwen2-0.5B, as Hugging Face counts it


def test_gpt2_config_exact_parameter_count():
    spec = load_model(EXAMPLES / "hf/gpt2/config.json")
    assert (spec.arch, spec.num_layers, spec.hidden_size, spec.ffn_hidden_size) == ("gpt", 12, 768, 3072)
    assert spec.tied_embeddings and spec.max_seq_len == 1024
    assert spec.num_params == 124_439_808  # GPT-2 small, as Hugging Face counts it


def test_hf_detected_by_architectures_alone():
    config = json.loads((EXAMPLES / "hf/mistral-7b/config.json").read_text())
    del config["model_type"]
    assert model_from_hf_config(config).num_kv_heads == 8


def test_hf_unknown_model_type_named(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "lama", "hidden_size": 64}))
    with pytest.raises(ConfigError, match=r"'lama' is no causal language model of the installed transformers .*"
                                          r"did you mean llama"):
        load_model(path)


def test_hf_config_without_a_closed_form_asks_for_the_directory():
    with pytest.raises(ConfigError, match=r"'falcon' has no closed form.*give its model directory"):
        model_from_hf_config({"model_type": "falcon", "hidden_size": 64})


def test_hf_missing_key_named(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}))
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        load_model(path)


def test_hf_decoupled_head_dim_is_priced():
    config = {"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4, "head_dim": 32,
              "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100}
    spec = model_from_hf_config(config)
    assert (spec.head_dim, spec.q_size, spec.qk_norm) == (32, 128, True)
    # q: 64x128, k and v: 64x64 (4 kv heads of 32), o: 128x64, q/k norms over head_dim
    assert spec.attention_params == 64 * 128 + 2 * 64 * 128 + 128 * 64 + 2 * 32


def test_hf_non_positive_size_named(tmp_path):
    config = json.loads((EXAMPLES / "hf/gpt2/config.json").read_text())
    config["n_layer"] = 0
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="num_layers=0"):
        load_model(path)


# ---- plait model files ----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gpt-small.yaml", "llama-1b.yaml", "llama3-8b-long.yaml"])
def test_example_model_files_load(name):
    assert isinstance(load_model(EXAMPLES / "models" / name), ModelSpec)


def test_model_file_on_top_of_preset():
    spec = load_model(EXAMPLES / "models/llama3-8b-long.yaml")
    assert spec == MODEL_PRESETS["llama3-8b"].replace(name="llama3-8b-32k", max_seq_len=32768)


def test_model_file_unknown_preset_names_file_and_preset(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("preset: llama3-9b\n")
    with pytest.raises(ConfigError, match=r"m.yaml: unknown model 'llama3-9b'; did you mean 'llama3-8b'"):
        load_model(path)


def test_json_model_file_round_trips(tmp_path):
    spec = MODEL_PRESETS["tiny-llama"]
    path = tmp_path / "m.json"
    path.write_text(json.dumps(spec.to_dict()))
    assert load_model(path) == spec


def test_model_file_name_defaults_to_stem(tmp_path):
    path = tmp_path / "mini.yaml"
    path.write_text("num_layers: 2\nhidden_size: 64\nnum_heads: 4\nvocab_size: 256\n")
    assert load_model(path).name == "mini"


def test_model_file_unknown_key_named(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("num_layers: 2\nhidden_size: 64\nnum_heads: 4\nvocab_size: 256\nlayers: 3\n")
    with pytest.raises(ConfigError, match=r"m.yaml: .*unknown key 'layers'"):
        load_model(path)


def test_model_file_non_positive_size_named(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("num_layers: 2\nhidden_size: -64\nnum_heads: 4\nvocab_size: 256\n")
    with pytest.raises(ConfigError, match="hidden_size=-64"):
        load_model(path)


def test_missing_file_named():
    with pytest.raises(ConfigError, match=r"model file 'no/such/model.yaml' does not exist"):
        load_model("no/such/model.yaml")


def test_malformed_yaml_says_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("num_layers: 2\nhidden_size: [64\nnum_heads: 4\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: not valid YAML: .* line \d+, column \d+"):
        load_model(path)


def test_malformed_json_says_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "num_layers": 2,\n  "hidden_size": 64,,\n}')
    with pytest.raises(ConfigError, match=r"bad.json: not valid JSON: .* line 3"):
        load_model(path)


def test_non_mapping_file_refused(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_model(path)


# ---- clusters -------------------------------------------------------------------------------
def test_cluster_file_with_units():
    spec = load_cluster(EXAMPLES / "clusters/a100-cluster.yaml")
    assert spec.memory_bytes == 80 * 2**30 and spec.peak_flops == 312e12
    assert spec.intra_node.bandwidth == 230e9 and spec.intra_node.latency_s == 5e-6
    assert spec.inter_node.bandwidth == 25e9  # 200 Gb/s
    assert (spec.num_devices, spec.devices_per_node, spec.name) == (64, 8, "my-a100s")


def test_cluster_file_on_top_of_preset_merges_links():
    spec = load_cluster(EXAMPLES / "clusters/h100-small.yaml")
    preset = CLUSTER_PRESETS["h100-80g"]
    assert spec.num_devices == 16 and spec.inter_node.bandwidth == 12.5e9
    assert spec.inter_node.latency_s == preset.inter_node.latency_s
    assert spec.efficiency == preset.efficiency and spec.intra_node == preset.intra_node


def test_cluster_written_by_to_dict_reads_back(tmp_path):
    import yaml

    spec = CLUSTER_PRESETS["local-cpu"].replace(num_devices=4, name="mine")
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(spec.to_dict()))
    assert load_cluster(path) == spec


def test_cluster_missing_field_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("num_devices: 8\nmemory_bytes: 80GiB\npeak_flops: 1e12\nintra_node: {latency_s: 0, bandwidth: 1e9}\n")
    with pytest.raises(ConfigError, match="missing required key 'inter_node'"):
        load_cluster(path)


def test_cluster_bad_unit_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("preset: a100-80g\nmemory_bytes: 80 parsecs\n")
    with pytest.raises(ConfigError, match=r"memory_bytes: cannot read '80 parsecs'"):
        load_cluster(path)


def test_cluster_non_positive_devices_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("preset: a100-80g\nnum_devices: 0\n")
    with pytest.raises(ConfigError, match="num_devices=0"):
        load_cluster(path)


@pytest.mark.parametrize("text, value", [
    ("80GiB", 80 * 2**30), ("80 GB", 80e9), ("512MiB", 512 * 2**20), (1e9, 1e9), ("8e10", 8e10),
])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def test_parse_rates_and_times():
    assert parse_flops("312 TFLOPS") == 312e12 and parse_flops("1.5 PFLOP/s") == 1.5e15
    assert parse_bandwidth("25 GB/s") == 25e9 and parse_bandwidth("400Gbps") == 50e9
    assert parse_seconds("5us") == 5e-6 and parse_seconds("0.5 ms") == 5e-4 and parse_seconds(3) == 3.0
    with pytest.raises(ConfigError):
        parse_seconds("5 parsecs")


# ---- train ----------------------------------------------------------------------------------
def test_load_train_fields_and_errors(tmp_path):
    assert load_train(global_batch=8, seq_len=128) == TrainSpec(global_batch=8, seq_len=128)
    path = tmp_path / "train.yaml"
    path.write_text("global_batch: 16\nseq_len: 64\nprecision: fp32\n")
    assert load_train(path, seq_len=32) == TrainSpec(global_batch=16, seq_len=32, precision="fp32")
    with pytest.raises(ConfigError, match="global_batch=0"):
        load_train(global_batch=0, seq_len=128)
    with pytest.raises(ConfigError, match="precision"):
        load_train(global_batch=1, seq_len=1, precision="int4")


def test_specs_pass_through():
    spec = MODEL_PRESETS["tiny-gpt"]
    assert load_model(spec) is spec
    cluster = CLUSTER_PRESETS["local-cpu"]
    assert isinstance(load_cluster(cluster), ClusterSpec)


def test_attention_path_is_read_from_a_model_file_and_checked(tmp_path):
    """ModelSpec.attention: fused by default, "math" where asked; anything else named with the choices."""
    assert MODEL_PRESETS["llama3-8b"].attention == "fused"
    path = tmp_path / "m.yaml"
    path.write_text("preset: llama3-8b\nattention: math\n")
    assert load_model(str(path)).attention == "math"
    path.write_text("preset: llama3-8b\nattention: flash\n")
    with pytest.raises(ConfigError, match="attention: 'flash' is not one of 'fused', 'math'"):
        load_model(str(path))
    with pytest.raises(ValueError, match="attention='flash' is not one of fused, math"):
        ModelSpec(num_layers=2, hidden_size=8, num_heads=2, vocab_size=16, attention="flash")
