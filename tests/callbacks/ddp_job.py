"""Fine-tune seed 1 under 2-process CPU DDP with AlignAndInterpolate (run as a script by the tests).

Usage: python ddp_job.py ROOT PRETRAINED REFERENCE
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2]))  # the repository, for `tests.` and `callbacks`

from callbacks import AlignAndInterpolate  # noqa: E402
from tests.runs import data, finetuned, trainer  # noqa: E402

if __name__ == "__main__":
    root, pretrained, reference = (Path(a) for a in sys.argv[1:4])
    callback = AlignAndInterpolate(references=[str(reference)], num_alphas=5, output_dir=str(root / "results"))
    run = trainer(root, steps=4, strategy="ddp", devices=2, callbacks=[callback])
    run.fit(finetuned(pretrained, 1), data())
    run.save_checkpoint(root / "seed1_ddp.ckpt")
