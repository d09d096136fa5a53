#!/bin/bash
# TorchX's dist.ddp component starts ddp under torchrun on any TorchX scheduler (kubernetes, slurm,
# aws_batch, local_cwd...): -j NODESxPROCESSES, the module ddp_cli, then ddp's arguments after --.
torchx run -s kubernetes dist.ddp -j 2x8 --gpu 8 --image registry.example.com/ddp:latest \
    -m ddp_cli -- train configs/demo.toml --run-dir /runs/ddp-demo --resume auto
