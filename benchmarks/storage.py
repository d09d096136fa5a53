"""The storage benchmark of BENCHMARKS.md ("Storage", "Parquet"): the same images as local files, local
shards, shards packed at 256 px, Hugging Face-style Parquet, S3 files, S3 shards and S3 Parquet (a loopback
moto server), read by the training pipeline.

    python benchmarks/storage.py /tmp/storage-bench --latency-ms 50 --workers 2 --seconds 60 [--rounds 3]

With `--pipeline-cpus 0` the measured pipeline may use CPU 0 only and moto's server (and the latency
proxy) the other CPUs: the server's work is then not charged to the node it feeds, as in a real region
(on loopback it shares the node's cores: bytes served, copied by the proxy, received).

It writes the images (benchmarks/make_jpegs.py: 300-500 px, photo-like), packs them with
`ddp datasets pack` (locally, to S3, and at --max-side 256), copies them into Parquet as the hub ships a
data set (benchmarks/parquet.py), starts moto's server, uploads the files and the Parquet, writes a
data.toml with the seven entries and runs `ddp bench data ... --latency-ms MS --json`, then prints the
ratios issues 12 and 27 ask for. Needs the test group (moto).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import s3fs
import tomli_w
from moto.server import ThreadedMotoServer
from parquet import to_parquet  # this folder's benchmarks/parquet.py

BUCKET = "ddp-bench"
ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
       "AWS_EC2_METADATA_DISABLED": "true"}


def ddp(*args: str, env: dict, cpus: set[int] | None = None) -> dict:
    out = subprocess.run([sys.executable, "-m", "ddp_cli", *args, "--json"], env=env, check=True,
                         capture_output=True, text=True,
                         preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("--latency-ms", type=float, default=50)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--per-class", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", help="the rows to time, e.g. files,s3_shards (the first is the baseline); "
                        "default: files,shards,shards_256,parquet,s3_files,s3_shards,s3_parquet")
    parser.add_argument("--pipeline-cpus", help="CPUs of the measured pipeline, e.g. 0 (the server and "
                        "the proxy get the others); default: every CPU for everything")
    args = parser.parse_args()
    measured = {int(c) for c in args.pipeline_cpus.split(",")} if args.pipeline_cpus else None
    root = args.root.resolve()
    files = root / "jpegs"
    if not files.exists():
        subprocess.run([sys.executable, str(Path(__file__).with_name("make_jpegs.py")), str(files),
                        "--classes", "10", "--per-class", str(args.per_class), "--val", "20"], check=True)
    if measured:
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)) - measured)  # moto's threads start here
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = {**os.environ, **ENV, "AWS_ENDPOINT_URL": endpoint}
    os.environ.update(ENV)
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint})
    fs.mkdir(BUCKET)
    fs.put(f"{files}/", f"{BUCKET}/jpegs/", recursive=True)
    if not (root / "parquet").exists():
        to_parquet(files, root / "parquet")
    fs.put(f"{root / 'parquet'}/", f"{BUCKET}/parquet/", recursive=True)

    def entry(name: str, path: str, layout: str, s3: bool = False) -> dict:
        storage = ({"driver": "S3", "path": path, "endpoint_url": endpoint} if s3
                   else {"driver": "FileSystem", "path": path})
        return {"name": name, "layout": layout, "storage": storage}

    entries = [entry("files", str(files), "imagenet-loc"),
               entry("shards", str(root / "shards"), "shards"),
               entry("shards_256", str(root / "shards-256"), "shards"),
               entry("parquet", str(root / "parquet"), "parquet"),
               entry("s3_files", f"s3://{BUCKET}/jpegs", "imagenet-loc", s3=True),
               entry("s3_shards", f"s3://{BUCKET}/shards", "shards", s3=True),
               entry("s3_parquet", f"s3://{BUCKET}/parquet", "parquet", s3=True)]
    registry = root / "data.toml"
    registry.write_text(tomli_w.dumps({"data_config_version": 1, "datasets": entries[:1]}))
    for to, extra in ((str(root / "shards"), []), (str(root / "shards-256"), ["--max-side", "256"]),
                      (f"s3://{BUCKET}/shards", [])):
        if not to.startswith("s3://") and Path(to, "index.json").exists():
            continue
        ddp("datasets", "pack", "files", "--registry", str(registry), "--to", to, "--split", "train",
            "--shard-size", "8", *extra, env=env)
    registry.write_text(tomli_w.dumps({"data_config_version": 1, "datasets": entries}))
    names = args.only.split(",") if args.only else [e["name"] for e in entries]
    result = ddp("bench", "data", *names, "--registry", str(registry),
                 "--latency-ms", str(args.latency_ms), "--workers", str(args.workers),
                 "--seconds", str(args.seconds), "--rounds", str(args.rounds), env=env, cpus=measured)
    server.stop()
    rows = {r["storage"] + ("@256" if r["dataset"] == "shards_256" else ""): r for r in result["rows"]}
    print(json.dumps(result, indent=1))

    def ratio(a: str, b: str) -> str:
        """a's rate over b's: of the whole run, then each round's (every row is timed once a round) and
        their median."""
        whole = rows[a]["images_per_second"] / rows[b]["images_per_second"]
        rounds = [p / q for p, q in zip(rows[a]["round_ratios"], rows[b]["round_ratios"], strict=True)]
        return (f"{whole:.2f} (rounds: {' '.join(f'{r:.2f}' for r in rounds)}; "
                f"median {statistics.median(rounds):.2f})")

    ms = f"{args.latency_ms:g} ms"
    for a, b, what in (("s3 shards", "local files", f"S3 shards @ {ms} / local files (target >= 0.9)"),
                       ("s3 files batched", "s3 files serial",
                        f"S3 files batched / serial @ {ms} (target >= 5)"),
                       ("local shards@256", "local files",
                        "local shards @ 256 px / local files (full size) (target >= 1.5)"),
                       ("local parquet", "local files", "local Parquet / local files (target >= 1.0)"),
                       ("s3 parquet", "s3 files batched", f"S3 Parquet / S3 files batched @ {ms}"),
                       ("s3 parquet", "local files", f"S3 Parquet @ {ms} / local files")):
        if a in rows and b in rows:
            print(f"{what}: {ratio(a, b)}")


if __name__ == "__main__":
    main()
