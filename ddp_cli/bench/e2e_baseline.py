"""The hand-written baseline of `ddp bench e2e`: a torchrun script as a user would write it.

`python -m torch.distributed.run --standalone --nproc-per-node 2 -m ddp_cli.bench.e2e_baseline
--root DEMO_ROOT ...`: torchvision's ImageFolder over the Kaggle layout's
train folders and a small CSV dataset for val (PIL decode, torchvision
transforms, float tensors), DistributedSampler, `DistributedDataParallel(model)`
with its defaults, SGD with momentum and a warmup + cosine schedule
(`--schedule constant`: the LR as given throughout, as torchvision's reference
recipe has it until its StepLR first steps at epoch 30), fp32 NCHW, and the
PyTorch DDP tutorial's loop. Deliberately independent of ddp's engine;
only the model comes from ddp, so both train the same network. Rank 0 prints
one JSON line per epoch (`epoch`, `top1`, `time` = unix seconds).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from PIL import Image
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision import datasets
from torchvision import transforms as T

from ddp_cli.config import ModelConfig
from ddp_cli.data.pipeline.transforms import MEAN, STD
from ddp_cli.models.zoo import build_model

IMAGES = Path("ILSVRC/Data/CLS-LOC")


class ValCsv(Dataset):
    """LOC_val_solution.csv: `ImageId,PredictionString` whose first word is the synset."""

    def __init__(self, root: Path, classes: list[str], transform: T.Compose) -> None:
        index = {synset: i for i, synset in enumerate(classes)}
        with open(root / "LOC_val_solution.csv", newline="") as f:
            rows = [(r["ImageId"], r["PredictionString"].split()[0]) for r in csv.DictReader(f)]
        self.items = [(root / IMAGES / "val" / f"{image}.JPEG", index[synset]) for image, synset in rows
                      if synset in index]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path, label = self.items[i]
        with Image.open(path) as img:
            return self.transform(img.convert("RGB")), label


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (`argv`, else sys.argv's): the data, the model and the recipe."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--model", default="resnet_tiny")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--val-resize", type=int, default=32)
    p.add_argument("--min-crop-scale", type=float, default=0.08)
    p.add_argument("--hflip", action="store_true")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--warmup-epochs", type=float, default=0)
    p.add_argument("--schedule", choices=("cosine", "constant"), default="cosine")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main() -> None:
    args = arguments()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    normalize = [T.ToTensor(), T.Normalize(MEAN, STD)]
    flip = [T.RandomHorizontalFlip()] if args.hflip else []
    crop = T.RandomResizedCrop(args.image_size, scale=(args.min_crop_scale, 1.0))
    train_set = datasets.ImageFolder(args.root / IMAGES / "train", T.Compose([crop, *flip, *normalize]))
    val_set = ValCsv(args.root, train_set.classes, T.Compose(
        [T.Resize(args.val_resize), T.CenterCrop(args.image_size), *normalize]))
    train_sampler = DistributedSampler(train_set, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, drop_last=True,
                              num_workers=args.workers)
    val_loader = DataLoader(val_set, args.batch_size, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=args.workers)

    model = DistributedDataParallel(build_model(ModelConfig(name=args.model), len(train_set.classes),
                                                args.image_size))
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    steps = len(train_loader)
    warmup, total = round(args.warmup_epochs * steps), args.epochs * steps

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if args.schedule == "constant":
            return 1.0
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for x, y in train_loader:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
            scheduler.step()
        model.eval()
        counts = torch.zeros(2)
        with torch.no_grad():
            for x, y in val_loader:  # DistributedSampler pads with repeats: the usual small bias
                counts += torch.tensor([(model(x).argmax(1) == y).sum().item(), len(y)])
        dist.all_reduce(counts)
        if rank == 0:
            print(json.dumps({"epoch": epoch + 1, "top1": (counts[0] / counts[1]).item(),
                              "time": time.time()}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
