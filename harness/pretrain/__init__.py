"""Pretraining the tiny hybrid target on the embedded corpus (cached as a local HF checkpoint).

``from harness.pretrain.target import PretrainConfig, ensure_pretrained_target``; the console script
is ``batchlab-pretrain-target`` (:mod:`harness.cli.pretrain_target`).
"""
