"""moekit-train --help-config: every setting documented from the config classes' own field comments."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from moekit.train.config import TrainConfig
from moekit.train.confighelp import describe, field_comments
from moekit.train.loop import main


@dataclass
class _Probe:
    alpha: int = 1  # the first
    beta: str = "x"  # the second,
                     # continued below
    # a section heading, not a continuation
    gamma: float = 0.5
    delta: bool = True  # last


def test_field_comments_are_read_from_the_source():
    assert field_comments(_Probe) == {"alpha": "the first", "beta": "the second, continued below", "delta": "last"}


def test_every_setting_of_every_section_is_explained(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help-config"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "(no description)" not in out
    cfg = TrainConfig()
    for section in ("model", "train", "data", "eval", "log", "checkpoint", "layout"):
        for f in dataclasses.fields(getattr(cfg, section)):
            assert f"--{section}.{f.name} " in out, (section, f.name)
    assert "--model.hidden_size int (default 128)" in out  # the preset's value


def test_one_section_and_another_preset(capsys):
    text = describe(TrainConfig.from_dict({"preset": "deepseek-tiny"}), "model")
    assert "[model]" in text and "[train]" not in text and "--model.num_experts int (default 16)" in text
    assert main(["--help-config", "modle"]) == 2
    assert "no such section" in capsys.readouterr().err
