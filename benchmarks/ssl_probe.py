"""What features learnt without labels would give at 2 labels a class (issue 59's probe, BENCHMARKS.md
"Semi-supervised"): SimCLR (Chen et al. 2020) on a data set's train images, their labels unread, then
`ddp train` starts from those weights (`model.weights`) on the few labels. Not a ddp feature: one process,
no checkpoint, no resume; it measures what a self-supervised stage before ddp's methods would be worth.

    python benchmarks/ssl_probe.py benchmarks/photos-fixmatch.toml --registry /tmp/photos64/data.toml \\
        --out /tmp/ssl.pt [--epochs 150] [--no-color] [--seed 0] [--json]
    ddp train benchmarks/photos-fixmatch.toml --registry /tmp/photos64/data.toml \\
        --set model.weights=/tmp/ssl.pt --set semi.labels_per_class=2 --set train.epochs=72 ...

The config gives the model (`model.name`, `model.kwargs`), the data set and its side (`data.image_size`).
Each image gets two views (a random resized crop of scale 0.2-1, a flip where `data.hflip`, and, unless
--no-color, SimCLR's colour jitter and grey); the model's pooled features (the input of its last Linear)
go through a projection MLP, and NT-Xent (temperature --temperature) pulls each image's two views
together against the batch's other views. SGD with Nesterov momentum, a warm-up of two epochs, then
cosine. The weights written are the model's (its classifier as initialised, since the loss never reads
it; the projection dropped), loadable by `model.weights`. Every --report-every epochs it prints a check
of the features: nearest-centroid val top-1 with --labels train images a class (the mean over 20 draws)
and with every train label. File-per-image layouts (imagenet-loc, imagefolder, csv).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
import time
import tomllib
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn
from torchvision.transforms import v2

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ddp_cli.config.model import ModelConfig  # noqa: E402
from ddp_cli.data.pipeline.transforms import MEAN, STD  # noqa: E402
from ddp_cli.data.registry import load_registry  # noqa: E402
from ddp_cli.data.sources.layouts import build_index  # noqa: E402
from ddp_cli.models.zoo import build_model  # noqa: E402


def nt_xent(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """SimCLR's loss of 2n projections, views 0..n-1 then their pairs n..2n-1: each view's cross-entropy
    of its cosine similarities / temperature to the 2n - 1 others, its pair the target, averaged."""
    z = F.normalize(z, dim=1)
    sim = (z @ z.T / temperature).fill_diagonal_(float("-inf"))
    n = len(z) // 2
    pairs = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    return F.cross_entropy(sim, pairs)


def read_split(registry: str, dataset: str, split: str, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A split's images as uint8 N x 3 x side x side (resized where they differ) and their labels."""
    entry = load_registry(Path(registry)).get(dataset)
    fs, root = entry.open()
    rows = build_index(fs, root, entry.layout).splits[split]
    images = []
    for i in range(len(rows)):
        image = Image.open(io.BytesIO(fs.cat(f"{root.rstrip('/')}/{rows.paths[i]}"))).convert("RGB")
        if image.size != (side, side):
            image = image.resize((side, side), Image.BICUBIC)
        images.append(torch.from_numpy(np.array(image)).permute(2, 0, 1))
    return torch.stack(images), torch.as_tensor(np.asarray(rows.labels), dtype=torch.long)


def views(side: int, hflip: bool, color: bool) -> v2.Compose:
    ops = [v2.RandomResizedCrop(side, scale=(0.2, 1.0), antialias=True)]
    ops += [v2.RandomHorizontalFlip()] if hflip else []
    if color:
        ops += [v2.RandomApply([v2.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8), v2.RandomGrayscale(p=0.2)]
    return v2.Compose(ops)


class Encoder(nn.Module):
    """The model up to its classifier: the pooled features its last Linear reads, caught by a hook."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.classifier = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
        self.classifier.register_forward_hook(self._catch)
        self.caught: torch.Tensor | None = None

    def _catch(self, module: nn.Module, inputs: tuple[torch.Tensor], output: torch.Tensor) -> None:
        self.caught = inputs[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.model(x)
        return self.caught


def normalise(images: torch.Tensor, norm: tuple) -> torch.Tensor:
    """As ddp normalises a batch for the model: (x / 255 - mean) / std, channels last; `norm` the run's
    (`data.mean`, `data.std`), ImageNet's where its config sets none."""
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in norm)
    return ((images.float() / 255 - mean) / std).contiguous(memory_format=torch.channels_last)


@torch.no_grad()
def centroid_top1(encoder: Encoder, train: tuple, val: tuple, labels: int, norm: tuple,
                  draws: int = 20) -> dict:
    """Nearest-centroid val top-1 of the features: `labels` train images a class (the mean over `draws`
    seeded draws), and every train label."""
    encoder.eval()
    (xt, yt), (xv, yv) = train, val
    ft = F.normalize(torch.cat([encoder(normalise(b, norm)) for b in xt.split(256)]), dim=1)
    fv = F.normalize(torch.cat([encoder(normalise(b, norm)) for b in xv.split(256)]), dim=1)
    encoder.train()
    classes = int(yt.max()) + 1

    def top1(centroids: list[torch.Tensor]) -> float:
        means = F.normalize(torch.stack(centroids), dim=1)
        return ((fv @ means.T).argmax(1) == yv).float().mean().item()

    few = []
    for draw in range(draws):
        g = torch.Generator().manual_seed(draw)
        picks = [(yt == c).nonzero().flatten() for c in range(classes)]
        few.append(top1([ft[p[torch.randperm(len(p), generator=g)[:labels]]].mean(0) for p in picks]))
    return {"few": round(sum(few) / draws, 4), "every": round(top1([ft[yt == c].mean(0)
                                                                    for c in range(classes)]), 4)}


def train(args: argparse.Namespace) -> dict:
    raw = tomllib.loads(Path(args.config).read_text())
    data, cfg = raw.get("data", {}), ModelConfig(**raw.get("model", {}))
    side, registry = data.get("image_size", 224), args.registry
    norm = (data.get("mean") or MEAN, data.get("std") or STD)
    torch.manual_seed(args.seed)
    train_set = read_split(registry, data["dataset"], "train", side)
    val_set = read_split(registry, data["dataset"], "val", side)
    classes = int(train_set[1].max()) + 1
    model = build_model(cfg, classes, side)
    encoder = Encoder(model)
    width = encoder.classifier.in_features
    projection = nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, args.projection))
    params = [*model.parameters(), *projection.parameters()]
    steps = len(train_set[0]) // args.batch_size
    total = args.epochs * steps
    opt = torch.optim.SGD(params, lr=args.lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    warm = 2 * steps
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * s / total)))
    augment = views(side, data.get("hflip", True), args.color)
    history = [{"epoch": 0, **centroid_top1(encoder, train_set, val_set, args.labels, norm)}]
    started = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(train_set[0]))
        for step in range(steps):
            batch = train_set[0][order[step * args.batch_size:(step + 1) * args.batch_size]]
            pair = torch.stack([augment(im) for im in (*batch, *batch)])  # views 0..n-1, then their pairs
            loss = nt_xent(projection(encoder(normalise(pair, norm))), args.temperature)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        if epoch % args.report_every == 0 or epoch == args.epochs:
            history.append({"epoch": epoch, "loss": round(loss.item(), 4),
                            **centroid_top1(encoder, train_set, val_set, args.labels, norm)})
            if not args.json:
                print(json.dumps(history[-1]), flush=True)
    torch.save(model.state_dict(), args.out)  # its classifier as initialised: the loss never reads it
    return {"out": str(args.out), "epochs": args.epochs, "color": args.color, "seed": args.seed,
            "seconds": round(time.perf_counter() - started, 1), "history": history}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a ddp run config: its model, data set and image size")
    parser.add_argument("--registry", required=True, help="the data.toml that holds the config's data set")
    parser.add_argument("--out", required=True, help="where the weights go (a state dict for model.weights)")
    parser.add_argument("--epochs", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=128, help="images a step (two views each)")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--temperature", type=float, default=0.2)
    parser.add_argument("--projection", type=int, default=64, help="the projection's output width")
    parser.add_argument("--no-color", dest="color", action="store_false", help="views by crop and flip only")
    parser.add_argument("--labels", type=int, default=2, help="labels a class of the nearest-centroid check")
    parser.add_argument("--report-every", type=int, default=25, help="epochs between the checks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    parser.add_argument("--json", action="store_true", help="one JSON object at the end, nothing else")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = train(args)
    print(json.dumps(result if args.json else {k: v for k, v in result.items() if k != "history"}))
    return result


if __name__ == "__main__":
    main()
