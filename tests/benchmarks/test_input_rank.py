"""benchmarks/input_rank: a study of the digits ViT recipes at narrower widths, heads unchanged."""

from pathlib import Path

from lmc.adapters import model_spec
from lmc.experiments.protocol import alignment_labels, experiment_cli
from lmc.experiments.study import Family, load_study

ROOT = Path(__file__).resolve().parents[2]


def test_the_width_study_changes_only_the_width_of_the_digits_vit_recipes(monkeypatch):
    monkeypatch.chdir(ROOT)  # study configs name their files relative to the repository
    study = load_study(["benchmarks/input_rank/study.yaml"])
    # The ViT experiments of the study on the digits, which the input-span test was run on.
    digits = {name: Family(name, name, f"configs/study/{name}.yaml").experiment for name in ("vit_ape", "vit_rope")}
    shapes = {}
    for family in study.families:
        assert family.table1 and family.experiment == digits[family.name.rsplit("_", 1)[0]]
        cli = experiment_cli(study.arguments(family, "first_attention"), run=False)
        layers = model_spec(cli.model.model).attention
        shapes[family.name] = {(layer.width, layer.num_heads, layer.head_dim) for layer in layers}
        assert len(layers) == 6
        protocol = study.protocol(family, "first_attention", cli)
        assert protocol.seeds == 5 and protocol.head_orders
        labels = alignment_labels(protocol.alignment_options)
        table1 = ["permutation", "orthogonal", "full", "full-metric=weight", "full-metric=correlation"]
        table1 += ["full-metric=weight-objective=data", "full-metric=activation", "full-metric=midpoint"]
        table1 += ["full-metric=midpoint-calibration_batches=all"]
        assert labels == [*table1, *alignment_labels(study.methods)]  # Table 1's, then the study's methods
    assert shapes == {
        "vit_ape_w64": {(64, 4, 16)},
        "vit_ape_w32": {(32, 4, 16)},
        "vit_ape_w16": {(16, 4, 16)},
        "vit_rope_w64": {(64, 4, 16)},
        "vit_rope_w16": {(16, 4, 16)},
    }
    assert alignment_labels(study.methods) == ["full-objective=data", "learned"]
