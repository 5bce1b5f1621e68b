"""What docs/extending.md tells a newcomer to write, verbatim: a data set and a model.

``tests/test_extending.py`` runs ``lmc run`` on them, so the recipe of docs/extending.md stays true.
"""

from __future__ import annotations

import torch

from lmc.data import LMCDataModule, TensorDictDataset
from lmc.models import register_model
from lmc.models.reference import ReferenceConfig, ReferenceTransformer
from lmc.tasks import DataInfo


class Stripes(LMCDataModule):
    """4-way classification of 6x6 grey images by the direction of their stripes (plus noise)."""

    task = "image_classification"

    def build(self) -> None:
        generator = torch.Generator().manual_seed(self.seed)
        labels = torch.randint(4, (600,), generator=generator)
        grid = torch.arange(6.0)
        patterns = torch.stack([grid[None, :].expand(6, 6), grid[:, None].expand(6, 6), grid[None] + grid[:, None],
                                grid[None] - grid[:, None]])  # fmt: skip
        images = torch.sin(patterns[labels] * 1.5) + 0.3 * torch.randn(600, 6, 6, generator=generator)
        split = {"train": slice(0, 400), "val": slice(400, 500), "test": slice(500, 600)}
        for name, rows in split.items():
            dataset = TensorDictDataset(inputs=images[rows, None], labels=labels[rows])
            setattr(self, f"{name}_set", dataset)

    @property
    def info(self) -> DataInfo:
        return DataInfo(self.task, num_classes=4, image_size=6, in_channels=1)


@register_model("stripes-vit")
def stripes_vit(data: DataInfo | None, overrides: dict) -> ReferenceTransformer:
    """A 2-layer reference ViT sized to the data (a new named variant)."""
    config = dict(task="image_classification", width=16, depth=2, num_heads=2, patch_size=2, pe="rope")
    if data is not None:
        config.update(num_classes=data.num_classes, image_size=data.image_size, in_channels=data.in_channels)
    config["max_positions"] = (config.get("image_size", 6) // config["patch_size"]) ** 2 + 1
    return ReferenceTransformer(ReferenceConfig(**{**config, **overrides}))
