"""``benchmarks/reliability/universal_conversion.py`` end to end at its tiny size: one rank, one
step, both converters measured (its few-GB figures are in docs/PERFORMANCE.md)."""

from __future__ import annotations

import json

from benchmarks.reliability import universal_conversion as bench


def test_the_benchmark_measures_both_converters(tmp_path, capsys):
    assert bench.main(["--size", "tiny", "--nproc", "1", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    from training.config.recipe import load_recipe
    cfg = load_recipe("recipes/tiny_dense.yaml", []).model
    assert result["largest_param"] == cfg.vocab_size * cfg.hidden_size       # the embedding
    for name in ("ours", "ds_to_universal"):
        assert result[name]["wall_s"] > 0 and result[name]["anon"] > 0, result
    assert (tmp_path / "run" / "checkpoints" / "universal" / "step00000001" / "manifest.json").is_file()
    assert (tmp_path / "ds_universal" / "zero" / "norm.weight" / "fp32.pt").is_file()
    assert any(line.startswith("| launch/to_universal.py |") for line in out)
