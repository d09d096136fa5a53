"""The train, checkpoint, distributed and logging sections: the run's length, its files, its processes."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, PositiveInt, model_validator

from ddp_cli.config.section import Section

EMA_BN_IMAGES = 256  # train.ema_bn_epochs: the train images the EMA's BatchNorm statistics are made from
MAX_EPOCHS = 1_000_000  # a typo'd 10**12 would hang the dry run's plan, which walks the epochs


class TrainConfig(Section):
    epochs: int = Field(90, ge=1, le=MAX_EPOCHS, description="Passes over the training split (at most a "
                        "million: the plan and the schedule walk them).")
    precision: Literal["fp32", "bf16", "fp16", "auto"] = Field(
        "auto", description="Autocast precision; fp16 uses a GradScaler and needs CUDA; auto = bf16 "
        "where the device computes it natively (CUDA 8.0+, CPUs with AVX-512 BF16 or AMX), else fp32."
    )
    grad_accum: int = Field(1, ge=1, description="Micro-steps per optimisation step.")
    max_steps_per_epoch: int = Field(0, ge=0, description="Cap on steps per epoch (0 = whole epoch).")
    compile: bool = Field(False, description="torch.compile the training forward/backward (slow start).")
    ema_decay: Annotated[float, Field(ge=0, lt=1)] | Literal["auto"] = Field(
        "auto", description="EMA of the weights, updated every ema_every_steps steps, validated each "
        "epoch as final_ema (0 = off; e.g. 0.9998). auto = 1 - 1/max(100, steps per epoch): an average "
        "over about an epoch (none under a semi.method without semi.ema_teacher: the live weights served "
        "as well or better there, docs/semi-supervised.md), written out in the run dir's config.toml.",
    )
    ema_every_steps: int = Field(
        1, ge=1, description="Update the EMA every N steps, with decay ema_decay ** N (the same "
        "averaging horizon in steps, 1/N of the cost; torchvision's recipes use 32).",
    )
    ema_bn_epochs: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        "auto", description="Before validating each of the first N epochs, recompute the EMA's BatchNorm "
        f"statistics from a fixed {EMA_BN_IMAGES} train images at the val crop (PreciseBN; 0 = never). "
        "auto = the epochs that end within the EMA's horizon (1 / (1 - decay) steps; 0 without an EMA), "
        "written out in the run dir's config.toml.",
    )


class CheckpointConfig(Section):
    dir: str | None = Field(
        None, description="The run dir when --run-dir is not given: a folder, or s3://BUCKET/PREFIX/NAME "
        "(a run in object storage, resumed from the bucket); unset = runs/NAME-YYYYmmdd-HHMMSS.",
    )
    every_steps: int = Field(0, ge=0, description="Also checkpoint every N steps (0 = epoch ends only).")
    keep_last: int = Field(3, ge=1, description="Step checkpoints kept besides last.pt and best.pt.")
    background: bool = Field(
        True, description="Write checkpoints on a background thread from a copy in CPU memory, so "
        "steps do not wait for the disk; one write at a time, and a stop or the run's end waits for it.",
    )
    best_metric: Literal["top1", "ema_top1"] | None = Field(
        None, description="What best.pt tracks: the val top-1 of the trained weights, or of their EMA "
        "(ema_top1 needs train.ema_decay > 0). Unset = ema_top1 where the run has an EMA, else top1; "
        "validate, predict and export use the same weights unless --weights says otherwise.",
    )
    on_world_size_change: Literal["rescale", "refuse"] = Field(
        "rescale", description="Resuming at another world size: \"rescale\" keeps the per-worker batch, "
        "scales the peak LR by the lr_per_256 rule and continues the schedule at the same epoch; "
        "\"refuse\" stops with exit 2.",
    )


class DistributedConfig(Section):
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="auto = nccl on a node with GPUs (one per worker; fewer GPUs than workers is "
        "refused), gloo on a node without."
    )
    nproc_per_node: PositiveInt | Literal["auto"] = Field(
        "auto", description="Workers on this node; auto = one per visible GPU, else cpu_workers."
    )
    cpu_workers: int = Field(1, ge=1, description="Workers per node when auto finds no GPU.")
    reduce: Literal["mean", "sum", "bf16", "fp16", "powersgd"] = Field(
        "mean", description="Gradient reduction (DDP comm hook); only mean equals single-process."
    )
    bucket_cap_mb: float = Field(25, gt=0, description="DDP gradient bucket size, MiB.")
    gradient_as_bucket_view: bool = Field(
        True, description="Gradients alias DDP's buckets (saves a copy and memory)."
    )
    static_graph: bool = Field(
        False, description="Tell DDP the graph is the same every step (enables its optimisations)."
    )
    powersgd_rank: int = Field(1, ge=1, description="powersgd: rank of the gradient approximation.")
    powersgd_warmup_steps: int | None = Field(
        None, ge=2, description="powersgd: exact all-reduce steps before compressing (unset = 10% of "
        "the run, at most 1000).",
    )
    timeout_s: int = Field(600, ge=1, description="Collective timeout; a dead rank ends all by then.")
    rdzv_timeout_s: int = Field(
        120, ge=1, description="How long nodes wait for each other (and for the endpoint) to rendezvous."
    )
    rdzv_last_call_s: int = Field(
        10, ge=0, description="With --nnodes MIN:MAX: once MIN nodes are in, how long the rendezvous "
        "waits for more (after a node is lost, the survivors wait this long before going on without it; "
        "a node later still joins at the next restart).",
    )
    max_restarts: int = Field(0, ge=0, description="Elastic restarts of the worker group on failure.")
    stop_check_steps: int = Field(
        10, ge=1, description="How often (in steps) the ranks agree on a stop signal (a small CPU "
        "all-reduce); also at every checkpoint due and epoch end. A SIGTERM/SIGINT stops the run at "
        "most this many steps later.",
    )
    stop_grace_s: int = Field(
        120, ge=1, description="On SIGTERM/SIGINT, how long workers get to finish the step and "
        "checkpoint before they are killed (a third signal kills them at once).",
    )


class WandbConfig(Section):
    project: str = Field(description="W&B project.")
    entity: str | None = Field(None, description="W&B entity (team or user).")
    name: str | None = Field(None, description="Run name (default: the run dir's name).")
    mode: Literal["online", "offline", "disabled"] = Field(
        "online", description='"offline" writes the run under the run dir with no network; '
        "`wandb sync` uploads it later.",
    )
    tags: list[str] = Field([], description="W&B tags.")


class MlflowConfig(Section):
    tracking_uri: str = Field(
        "mlruns", description="Where runs are tracked: a folder (a local store, relative to the working "
        "directory) or a tracking server's URL (http://host:5000).")
    experiment: str = Field("ddp", min_length=1, description="Experiment name (created if missing).")
    run_name: str | None = Field(None, description="Run name (default: the run dir's name).")
    log_model: bool = Field(True, description="At the end, the exported model (state_dict and its card) and "
                            "the run's report picture as artefacts.")
    registered_model: str | None = Field(
        None, min_length=1, description="Also register the exported model under this name in the model "
        "registry (needs log_model).")


class LoggingConfig(Section):
    every_steps: int = Field(50, ge=1, description="Log a training line (and metrics record) every N steps.")
    tensorboard: bool = Field(False, description="Also write TensorBoard event files to <run>/tensorboard.")
    wandb: WandbConfig | None = Field(None, description="[logging.wandb]: also log to Weights & Biases.")
    mlflow: MlflowConfig | None = Field(None, description="[logging.mlflow]: also log to MLflow (rank 0; a "
                                        "tracking server that fails is retried, never stops training).")

    @model_validator(mode="after")
    def _registry_needs_the_model(self) -> LoggingConfig:
        if self.mlflow and self.mlflow.registered_model and not self.mlflow.log_model:
            raise ValueError("logging.mlflow.registered_model: registers the logged model; set "
                             "logging.mlflow.log_model = true or remove registered_model")
        return self


