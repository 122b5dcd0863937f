"""LoRA adapters alone, as a PEFT adapter folder (moekit.models.hf.peft, ``moekit-convert export-lora``): the
factors against the merged model's HF export computed another way, per expert and on transformers 5's fused experts,
and the folder loaded the way users load it, through transformers and PEFT (moekit.models.hf.peft_check)."""
from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch

from moekit.models.config import preset
from moekit.models.lora import merge_lora
from moekit.models.transformer import build_model
from moekit.train.loop import main as train_main
from tests.helpers import gen, one_stderr_line
from tests.test_lora import DEEPSEEK


def hf_folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("name, targets", [("mixtral-tiny", "all"), ("mixtral-tiny", "layers.1.*,layers.3.ffn.*"),
                                           ("deepseek-tiny", "all"), ("qwen3.5-tiny", "all"),
                                           ("gpt-oss-tiny", "*.attn.*")])
def test_peft_adapter_plus_the_base_checkpoint_is_the_merged_export(tmp_path, name, targets):
    """save_peft's factors, added to the HF checkpoint of the base weights, give the HF checkpoint of the merged
    model tensor for tensor (computed another way: merge_lora, then save_hf); the config's regex names exactly the
    adapted Linears; gpt-oss's fused expert tensors have no per-Linear adapter and are refused by name."""
    import re

    from safetensors.torch import load_file

    from moekit.models.hf import save_hf
    from moekit.models.hf.peft import adapter_metadata, apply_peft, save_peft

    model = lora_model_with_adapters(name, targets)
    cfg = model.config
    import copy

    plain = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in plain.named_parameters():
            if ".lora_b" in n:
                p.zero_()
    merged = merge_lora(copy.deepcopy(model))
    save_hf(plain, tmp_path / "base")
    save_hf(merged, tmp_path / "merged")
    out = save_peft(model, tmp_path / "adapter", base_model="some/base")
    adapter = load_file(out / "adapter_model.safetensors")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 12.0 and config["base_model_name_or_path"] == "some/base"
    assert "moekit" not in config  # PEFT warns about keys it does not know; moekit's notes are in the file's header
    assert adapter_metadata(out) == {"moekit_family": json.loads((tmp_path / "base" / "config.json").read_text())[
        "model_type"], "moekit_targets": targets, "moekit_layout": "per_expert", "moekit_parameters": "{}"}
    base, want = hf_folder_tensors(tmp_path / "base"), hf_folder_tensors(tmp_path / "merged")
    got = apply_peft(base, adapter, 3.0)
    changed = 0
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
        changed += int(not torch.equal(base[k], v))
    adapted = {k[len("base_model.model."): -len(".lora_A.weight")] for k in adapter if k.endswith(".lora_A.weight")}
    assert changed == len(adapted) > 0  # every adapted Linear changed, and nothing else
    linears = {k[: -len(".weight")] for k, v in base.items() if k.endswith(".weight") and v.dim() == 2}
    assert {m for m in linears if peft_selects(config["target_modules"], m)} == adapted
    # the plain list of last names wherever it is exact (PEFT users' form), else a regex
    if targets == "all" and name in ("mixtral-tiny", "deepseek-tiny"):
        assert isinstance(config["target_modules"], list)
    if targets.startswith("layers.1.*"):
        assert isinstance(config["target_modules"], str)
    if isinstance(config["target_modules"], str) and name == "mixtral-tiny":  # transformers >= 5's expert names too
        assert re.fullmatch(config["target_modules"], "model.layers.3.mlp.experts.w2")
        assert not re.fullmatch(config["target_modules"], "model.layers.2.mlp.experts.w2")
    if name == "gpt-oss-tiny":
        with pytest.raises(ValueError, match=r"experts\.w_in -> .*stores its experts fused: .*--layout fused"):
            save_peft(build_model(dataclasses.replace(cfg, lora_targets="all")), tmp_path / "x")


@pytest.mark.parametrize("name, targets", [("mixtral-tiny", "layers.1.*,layers.3.ffn.experts.w_out"),
                                           ("qwen3.5-tiny", "all"), ("gpt-oss-tiny", "all"), ("llama4-tiny", "all")])
def test_fused_peft_adapter_plus_the_fused_base_is_the_merged_export(tmp_path, name, targets):
    """layout "fused": the experts' adapters as PEFT's adapters on transformers >= 5's fused expert parameters
    (target_parameters; gpt-oss's interleaved and transposed, Llama 4's [E, in, out]); each expert's delta, added to
    the base's fused tensors, gives the merged model's (merge_lora, then the fused export), tensor for tensor. Two
    parameters of one module nest as PEFT nests them: the first registered is reached through base_layer."""
    from safetensors.torch import load_file

    from moekit.models.hf import export_rules
    from moekit.models.hf.peft import adapter_metadata, apply_peft, save_peft
    from moekit.models.hf.weights import export_tensors

    import copy

    model = lora_model_with_adapters(name, targets)
    out = save_peft(model, tmp_path / "adapter", layout="fused")
    meta = adapter_metadata(out)
    family = meta["moekit_family"]
    assert meta["moekit_layout"] == "fused" and meta["moekit_targets"] == targets
    parameters = {k: tuple(v) for k, v in json.loads(meta["moekit_parameters"]).items()}
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_parameters"] == [key for key, _ in parameters.values()]
    for where, (key, transposed) in parameters.items():
        container, _, param = key.rpartition(".")
        both = sum(k.startswith(container + ".") for k in config["target_parameters"]) == 2
        assert where == container + (".base_layer" if both and param == "gate_up_proj" else "")
        assert transposed == (name == "gpt-oss-tiny")

    def tensors(m):
        return export_tensors(m, export_rules(m, family, None, "fused")[1], None)

    base, want = tensors(model), tensors(merge_lora(copy.deepcopy(model)))
    adapter = load_file(out / "adapter_model.safetensors")
    got = apply_peft(base, adapter, 3.0, parameters)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
    changed = {k for k in want if not torch.equal(base[k], want[k])}
    assert {key for key, _ in parameters.values()} <= changed  # every expert parameter with an adapter, and one
    assert len(changed) == sum(k.endswith(".lora_A.weight") for k in adapter)  # tensor per adapter: no other


def peft_selects(target_modules, module: str) -> bool:
    """PEFT's rule: a string is a regex the whole module name matches; a list names modules by their last parts."""
    import re

    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, module) is not None
    return any(module == t or module.endswith(f".{t}") for t in target_modules)


def lora_model_with_adapters(name: str, targets: str, rslora: bool = False):
    cfg = dataclasses.replace(preset(name), lora_rank=4, lora_alpha=12.0, lora_targets=targets, lora_rslora=rslora)
    model = build_model(cfg, seed=random.randrange(1 << 20))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_b" in n:
                p.normal_(0.0, 0.05, generator=gen("peft-load", name, n))
    return model


@pytest.mark.parametrize("name, targets, layout", [
    ("mixtral-tiny", "all", "per_expert"), ("mixtral-tiny", "layers.1.*,layers.3.ffn.*", "per_expert"),
    ("deepseek-tiny", "*.attn.*,*.ffn.experts.*", "per_expert"), ("gpt-oss-tiny", "*.attn.*", "per_expert"),
    ("deepseek-tiny", "all", "per_expert"),
    ("mixtral-tiny", "layers.1.*,layers.3.ffn.experts.w_out", "fused"), ("deepseek-tiny", "*.attn.*,*.experts.*", "fused"),
    ("qwen3.5-tiny", "all", "fused"), ("gpt-oss-tiny", "all", "fused"), ("llama4-tiny", "all", "fused")])
def test_peft_loads_the_adapter_onto_the_base_with_the_model_logits(tmp_path, name, targets, layout):
    """What users run: transformers loads the base checkpoint (fusing the experts, transformers >= 5) and PEFT the
    adapter folder; the logits are the LoRA model's. Shared experts and dense FFNs of the Qwen2-MoE-pattern families
    are the one known PEFT limit (models/hf/peft.py): there the check must say so, naming them."""
    pytest.importorskip("peft")
    from moekit.models.hf.peft import save_peft
    from moekit.models.hf.peft_check import check_with_peft

    model = lora_model_with_adapters(name, targets)
    check = check_with_peft(model, save_peft(model, tmp_path / "adapter", layout=layout))
    if name == "deepseek-tiny" and targets == "all" and not check.ok:
        assert check.ok is False and "shared_experts.gate_proj" in check.message, check.message
        assert "experts.N." not in check.message  # the routed experts did load
        assert "--layout fused" in check.message
    else:
        assert check.ok, check.message


def test_the_peft_check_fails_for_a_missing_module_and_for_wrong_tensors(tmp_path, monkeypatch):
    """The check can fail: an adapter_config that drops a module is named; factors that PEFT loads everywhere but
    that are not the model's adapters are an export bug (ValueError). A model whose two float32 copies would take
    more than half the free memory is not loaded at all: said, not attempted."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file, save_file

    from moekit.models.hf import peft_check
    from moekit.models.hf.peft import save_peft
    from moekit.models.hf.peft_check import check_with_peft

    model = lora_model_with_adapters("mixtral-tiny", "all")
    out = save_peft(model, tmp_path / "adapter")
    need = 8 * sum(p.numel() for p in model.parameters())
    with monkeypatch.context() as m:
        m.setattr(peft_check, "_available_bytes", lambda: 2 * need - 8)
        check = check_with_peft(model, out)
        assert check.ok is None and "two float32 copies of the model" in check.message
    config = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**config, "target_modules": [
        t for t in config["target_modules"] if t != "v_proj"]}))
    check = check_with_peft(model, out)
    assert check.ok is False and "self_attn.v_proj" in check.message and "4 adapted module(s)" in check.message
    out = save_peft(model, tmp_path / "adapter2")
    tensors = load_file(out / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight"  # every token goes through it
    tensors[key] = tensors[key] + 0.5
    save_file(tensors, out / "adapter_model.safetensors", {"format": "pt"})
    with pytest.raises(ValueError, match="loads the adapter onto every adapted module and computes other logits"):
        check_with_peft(model, out)


def test_export_lora_writes_the_adapter_of_a_run_and_refuses_more(tmp_path, capsys):
    from moekit.train.convert import main as convert

    run = tmp_path / "run"
    assert train_main([*DEEPSEEK, "--steps", "2", "--run-dir", str(run)]) == 0
    capsys.readouterr()
    assert convert(["export-lora", str(run), str(tmp_path / "adapter"), "--verify"]) == 0
    out, err = capsys.readouterr()
    assert "PEFT LoRA adapter (rank 4, alpha 16, per_expert experts)" in out
    assert "verified: the base checkpoint plus the adapter" in out
    peft_line = out.splitlines()[-1] + err  # the load through PEFT, when it is installed
    assert ("verified: PEFT" in peft_line or "WARNING: PEFT" in peft_line and "shared_experts" in peft_line
            or "peft is not installed" in peft_line), peft_line
    assert convert(["export-lora", str(run), str(tmp_path / "fused"), "--layout", "fused", "--verify"]) == 0
    out, err = capsys.readouterr()
    assert "fused experts" in out and "verified: the base checkpoint plus the adapter" in out
    assert json.loads((tmp_path / "fused" / "adapter_config.json").read_text())["target_parameters"]
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    routers = tmp_path / "routers"
    assert train_main([*DEEPSEEK, "--steps", "1", "--train.trainable", "*.router.*", "--run-dir", str(routers)]) == 0
    capsys.readouterr()
    assert convert(["export-lora", str(routers), str(tmp_path / "a2")]) == 2
    one_stderr_line(capsys, "trained more than its adapters", "--train.trainable '*.router.*'", "merge-lora")
