"""LMCModule: re-initialization strategies freeze everything else, bit for bit."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lmc.adapters import scope_parameters
from lmc.checkpoints import CheckpointError
from lmc.data import Digits, PythonDocsLM, PythonTextKinds
from lmc.symmetry import SCOPES
from lmc.training import LMCModule
from tests.runs import trainer

BACKBONES = {
    "reference-vit-tiny": Digits,
    "vit-tiny": Digits,
    "rope-vit-tiny": Digits,
    "hf-vit-tiny": Digits,  # transformers' ViTForImageClassification, fed pixel_values
    "gpt2-tiny": PythonDocsLM,
    "llama-tiny": PythonDocsLM,
    "mistral-tiny": PythonDocsLM,
    "qwen2-tiny": PythonDocsLM,
    "qwen3-tiny": PythonDocsLM,
    "olmo2-tiny": PythonDocsLM,
    "gemma-tiny": PythonDocsLM,
    "gemma2-tiny": PythonDocsLM,
    "phi3-tiny": PythonDocsLM,
    "gpt-neox-tiny": PythonDocsLM,  # Pythia's layout
    "bert-tiny": PythonTextKinds,
    "roformer-tiny": PythonTextKinds,
}


def _trainer(root, steps: int = 3) -> L.Trainer:
    return trainer(root, steps, limit_val_batches=1)


@pytest.fixture(scope="module")
def pretrained_checkpoints(tmp_path_factory):
    """One briefly pre-trained checkpoint per backbone."""
    paths = {}
    for name, data_class in BACKBONES.items():
        data = data_class(batch_size=16)
        module = LMCModule(name, data=data.info)
        trainer = _trainer(tmp_path_factory.mktemp(name), steps=2)
        trainer.fit(module, data)
        paths[name] = tmp_path_factory.mktemp("ckpt") / f"{name}.ckpt"
        trainer.save_checkpoint(paths[name])
    return paths


def _weights(module: LMCModule) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.model.named_parameters()}


@pytest.mark.parametrize("reinit", SCOPES)
@pytest.mark.parametrize("name", list(BACKBONES))
def test_only_reinitialized_parameters_train(name, reinit, pretrained_checkpoints, tmp_path):
    data = BACKBONES[name](batch_size=16)
    module = LMCModule(name, data=data.info, reinit=reinit, reinit_seed=1, pretrained=str(pretrained_checkpoints[name]))
    pretrained = LMCModule(name, data=data.info, pretrained=str(pretrained_checkpoints[name]))
    chosen = set(scope_parameters(module.model, reinit))
    start = _weights(module)

    assert {n for n, p in module.model.named_parameters() if p.requires_grad} == chosen
    for n, value in _weights(pretrained).items():  # re-initialized = changed, the rest = the checkpoint's
        assert torch.equal(start[n], value) == (n not in chosen), n
    _trainer(tmp_path).fit(module, data)

    optimizer = module.trainer.optimizers[0]
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for n, p in module.model.named_parameters() if n in chosen}
    for n, value in _weights(module).items():
        if n in chosen:
            assert not torch.equal(value, start[n]), f"{n} did not train"
        else:
            assert torch.equal(value, start[n]), f"frozen {n} changed"


@pytest.mark.parametrize("reinit", ["first_attention", "first_block"])
def test_two_seeds_differ_only_in_the_reinitialized_parameters(reinit, pretrained_checkpoints, tmp_path):
    name = "llama-tiny"
    data = BACKBONES[name](batch_size=16)
    runs = []
    for seed in (0, 1):
        module = LMCModule(
            name,
            data=data.info,
            reinit=reinit,
            reinit_seed=seed,
            pretrained=str(pretrained_checkpoints[name]),
        )
        _trainer(tmp_path / str(seed)).fit(module, data)
        runs.append(_weights(module))
    chosen = set(scope_parameters(module.model, reinit))
    differing = {n for n in runs[0] if not torch.equal(runs[0][n], runs[1][n])}
    assert differing == chosen


def test_same_seed_reinitializes_identically(pretrained_checkpoints):
    data = Digits()
    path = str(pretrained_checkpoints["vit-tiny"])
    a = LMCModule("vit-tiny", data=data.info, reinit="all_attention", reinit_seed=3, pretrained=path)
    b = LMCModule("vit-tiny", data=data.info, reinit="all_attention", reinit_seed=3, pretrained=path)
    assert all(torch.equal(x, y) for x, y in zip(_weights(a).values(), _weights(b).values()))


def test_bad_configuration_is_refused(pretrained_checkpoints, tmp_path):
    from lmc.checkpoints import save_weights

    with pytest.raises(ValueError, match="unknown scope 'first_layer'; choose one of first_attention"):
        LMCModule("vit-tiny", reinit="first_layer")
    with pytest.raises(ValueError, match="set pretrained to its checkpoint"):
        LMCModule("vit-tiny", reinit="first_attention")
    with pytest.raises(ValueError, match="unknown model 'resnet'"):
        LMCModule("resnet")
    # A checkpoint's own settings, where it has them, must be the model's: the shapes may fit another function.
    checkpoint = str(pretrained_checkpoints["reference-vit-tiny"])
    with pytest.raises(CheckpointError, match=r"is another model than this one \(model_config \{\} there, \{'pe'"):
        LMCModule(
            "reference-vit-tiny", {"pe": "learned", "rope_layout": "interleaved"}, Digits().info, pretrained=checkpoint
        )
    # Weights without settings are checked by their names and shapes.
    weights = save_weights(LMCModule("vit-tiny", data=Digits().info).model, tmp_path / "vit.safetensors")
    with pytest.raises(CheckpointError, match="does not fit VisionTransformer.*shape"):
        LMCModule("vit-tiny", model_config={"embed_dim": 48}, data=Digits().info, pretrained=str(weights))
    with pytest.raises(CheckpointError, match="does not exist"):
        LMCModule("vit-tiny", pretrained="/nonexistent/model.ckpt")


def test_language_model_logs_bits_per_token(tmp_path):
    data = PythonDocsLM(batch_size=8, sequence_length=16)
    module = LMCModule("reference-tiny", data=data.info)
    trainer = _trainer(tmp_path, steps=1)
    trainer.validate(module, data, verbose=False)
    metrics = trainer.callback_metrics
    assert torch.isclose(metrics["val/bits_per_token"], metrics["val/loss"] / torch.log(torch.tensor(2.0)))


@pytest.mark.parametrize("name", ["reference-vit-tiny", "gpt2-tiny"])
def test_logged_epoch_metrics_are_the_exact_sample_weighted_means(name, tmp_path):
    from lmc.connectivity.interpolation import evaluate, point_metrics

    data = BACKBONES[name](batch_size=7)  # batches of unequal size: a mean of batch means would differ
    module = LMCModule(name, data=data.info)
    run = trainer(tmp_path, steps=1, limit_val_batches=None)
    (logged,) = run.validate(module, data, verbose=False)
    data.setup()
    expected = point_metrics(
        {k: float(v) for k, v in evaluate(module.metric_sums, data.val_dataloader(), "cpu").items()}
    )
    assert logged["val/loss"] == pytest.approx(expected["loss"], rel=1e-6)
    assert logged["val/accuracy"] == pytest.approx(expected["accuracy"], rel=1e-6)
    if name == "gpt2-tiny":
        assert logged["val/bits_per_token"] == pytest.approx(expected["loss"] / 0.6931471805599453, rel=1e-6)


@pytest.mark.parametrize("name", ["reference-vit-tiny", "gpt2-tiny"])
def test_sample_sums_are_each_samples_own_sums_and_add_up_to_the_batchs(name):
    data = BACKBONES[name](batch_size=5)
    data.setup()
    module = LMCModule(name, data=data.info).double().eval()
    batch = next(iter(data.val_dataloader()))
    batch = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    with torch.no_grad():
        per_sample, whole = module.sample_sums(batch), module.metric_sums(batch)
        alone = [module.metric_sums({k: v[i : i + 1] for k, v in batch.items()}) for i in range(len(batch["labels"]))]
    assert set(per_sample) == set(whole) == {"count", "loss", "accuracy"}
    for metric, values in per_sample.items():
        assert values.shape == (5,) and values.dtype == torch.float64 and whole[metric].ndim == 0
        # each sample scored in a batch of its own: its entry (float64, so rounding only)
        expected = torch.stack([sums[metric] for sums in alone])
        torch.testing.assert_close(values, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(whole[metric], expected.sum(), rtol=1e-12, atol=0)
    tokens = batch["labels"][0].numel()
    assert per_sample["count"].tolist() == [float(tokens)] * 5  # a sequence counts its tokens


def test_training_does_not_depend_on_validation_settings(tmp_path):
    """The training order comes from the run's seed alone: validating (or not) changes nothing."""
    weights = []
    without = {"limit_val_batches": 0, "num_sanity_val_steps": 0}
    for validation in (without, {"limit_val_batches": 2, "num_sanity_val_steps": 2}):
        L.seed_everything(7, verbose=False)
        module = LMCModule("reference-vit-tiny", data=Digits().info, lr=3e-3)
        run = trainer(tmp_path, steps=9, limit_train_batches=3, **validation)  # 3 epochs: 3 shuffles
        run.fit(module, Digits(batch_size=16))
        weights.append(_weights(module))
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
