"""Mutation score of the core modules: mutmut mutates them, each against its own unit tests (not part of the suite).

Usage:
    python benchmarks/mutation_score.py                      # every target; prints survivors
    python benchmarks/mutation_score.py --only planned       # one target
    python benchmarks/mutation_score.py --write              # also rewrite its section of RESULTS.md
    python benchmarks/mutation_score.py --resume --work DIR  # continue a stopped run where it left off

The project is copied (tracked and untracked, not ignored files) into a work folder, where mutmut's
configuration is added to the copy's ``pyproject.toml``; the checkout is never touched. Survivors judged
equivalent (the code means the same after the mutation) are listed in :data:`EQUIVALENT` with the reason;
the score counts killed mutants against the non-equivalent ones.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import cpu_model, write_section  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TITLE = "## Mutation score of the core modules (mutmut)"
GOAL = 0.90

#: target -> (the modules mutated, their own test modules)
TARGETS: dict[str, tuple[list[str], list[str]]] = {
    "strategies": (
        ["strategies/*.py"],
        ["tests/strategies/test_strategies.py", "tests/strategies/test_strategies_properties.py", "tests/strategies/test_strategies_remainder.py",
         "tests/strategies/test_strategies_step_tokens.py", "tests/strategies/test_strategy_claims.py", "tests/strategies/test_strategy_plugin.py",
         "tests/strategies/test_edges.py", "tests/strategies/test_plan_metrics.py", "tests/strategies/test_validate.py",
         "tests/strategies/test_option_parsing.py", "tests/strategies/test_plan_accessors.py",
         "tests/strategies/test_remainder_arguments.py", "tests/strategies/test_padded_slots_edges_check.py",
         "tests/strategies/test_length_int64_bounds.py", "tests/strategies/test_registry_unregister.py",
         "tests/strategies/test_balance_slots.py", "tests/strategies/test_rank_balance_options.py",
         "tests/strategies/test_run_arguments.py", "tests/strategies/test_registry_lookups.py",
         "tests/strategies/test_step_length_metrics.py", "tests/strategies/test_bucket_streak_edges.py",
         "tests/strategies/test_step_spread_edges.py", "tests/strategies/test_plan_metrics_arguments.py",
         "tests/strategies/test_plan_metrics_report.py", "tests/strategies/test_cost_model_target_only.py",
         "tests/strategies/test_registry_register.py", "tests/strategies/test_autocorrelation_edges.py",
         "tests/strategies/test_bucketed_token_steps_delegation.py",
         "tests/strategies/test_cost_model_coefficients.py", "tests/strategies/test_cut_token_steps_dtypes.py",
         "tests/strategies/test_drafter_blocks_dtypes.py", "tests/strategies/test_explicit_edges_checks.py",
         "tests/strategies/test_length_grouped_option_messages.py",
         "tests/strategies/test_megabatch_size_rounding.py", "tests/strategies/test_micro_batch_costs_empty.py",
         "tests/strategies/test_modelled_bucket_recurrence.py", "tests/strategies/test_packed_fit_choice.py",
         "tests/strategies/test_real_slots_first_order.py", "tests/strategies/test_same_bucket_token_steps.py",
         "tests/strategies/test_sample_step_missing.py", "tests/strategies/test_sorted_ties_order.py",
         "tests/strategies/test_token_slot_table_empty.py", "tests/strategies/test_recurrence_dropped_samples.py",
         "tests/strategies/test_bucket_edges_messages.py"],
    ),
    "checkpoint": (
        ["harness/train/loop/checkpoint.py", "harness/train/loop/train_state.py", "harness/train/loop/consumed.py"],
        ["tests/harness/train/test_integrity.py", "tests/harness/train/test_train_components.py", "tests/harness/train/test_checkpoint_state.py"],
    ),
    "anchors": (
        ["harness/models/anchors.py", "harness/models/drafter_inputs.py"],
        ["tests/harness/models/test_drafter_inputs.py", "tests/harness/train/test_epoch_draws.py", "tests/harness/models/test_drafter.py",
         "tests/harness/models/test_drafter_packing.py"],
    ),
    "planned": (["analysis/planned.py"], ["tests/analysis/test_analysis_planned.py"]),
}
#: whole training runs (a subprocess or many steps, 8-21 s each) that call nearly every function above: each surviving
#: mutant would pay for all of them; the unit tests beside them in the same modules cover the same functions
NOT_RUN = [
    "tests/harness/train/test_integrity.py::test_a_run_never_trains_on_a_damaged_cache_entry",
    "tests/harness/train/test_epoch_draws.py::test_a_two_epoch_runs_batches_and_anchors_change_with_the_epoch_and_repeat_on_a_rerun",
    "tests/strategies/test_strategy_plugin.py::test_it_trains_and_is_reported_next_to_sorted",
]
#: never mutated: numba compiles these functions, and mutmut's trampolines cannot run inside them
NOT_MUTATED = ["strategies/kernels.py"]
#: packages copied whole, so that unmutated modules beside the mutated ones import as usual
SOURCE_PACKAGES = ["strategies", "harness", "analysis", "batchlab"]

#: surviving mutants whose code means the same as the original: name -> why
EQUIVALENT: dict[str, str] = {
    "analysis.planned.x_planned_results__mutmut_100": "multipletests without alpha=: Holm's adjusted p-values "
    "(pvals * (m..1), running max, clipped at 1) never read alpha; only its reject flags do, and they are unused",
    "analysis.planned.x_planned_results__mutmut_105": 'method="HOLM": multipletests matches method.lower() against '
    '["h", "holm"], so the same branch runs',
    "analysis.planned.x_planned_results__mutmut_132": "mean <= 0 vs mean < 0 differs only at mean == 0.0, where "
    "ttest_rel's t (np.mean of the same a - b over its s.e.) is 0 or nan: p is 1 or nan, and Holm's p_holm >= p "
    "is never < alpha for any alpha in (0, 1) (load_preregistration holds it in (0, 0.5)), so the branch never runs",
    "harness.train.loop.checkpoint.x_checkpoint_paths__mutmut_6": "sorted by the paths themselves (key=None) instead "
    "of by name: every path is directory / name in one directory, and PurePath orders by its parts, which share the "
    "directory's and then compare the names as strings, so the order is the same",
    "harness.train.loop.checkpoint.x_checkpoint_paths__mutmut_8": "sorted(...) without key=: the same order as key=None "
    "(x_checkpoint_paths__mutmut_6): paths of one directory order by their names",
    "harness.train.loop.checkpoint.x_check_versions__mutmut_20": "found <= FORMAT_VERSION vs found < FORMAT_VERSION "
    "differs only at found == FORMAT_VERSION, and this line runs only when found != FORMAT_VERSION (an int: "
    "isinstance is checked first)",
    "harness.train.loop.checkpoint.x_check_versions__mutmut_56": "entry.get(\"version\", 0) <= version vs < differs "
    "only when the two are equal, which the elif excludes unless the entry has no version (default 0) and the "
    "component's state_version is 0; every Stateful the package saves has version 1 or 2 (versions start at 1)",
    "harness.models.anchors.x_block_input_ids__mutmut_5": "torch.full without dtype= infers int64 from the int fill "
    "value mask_token_id (the default dtype only applies to float fills)",
    "harness.models.anchors.x_block_input_ids__mutmut_9": "torch.full without dtype= infers int64 from the int fill "
    "value mask_token_id (the default dtype only applies to float fills)",
    "harness.models.anchors.x_build_block_layout__mutmut_87": "anchor[a:b] = positions... copies into anchor, made on "
    "the documents' device: a slice assignment copies across devices, so where the right-hand side lives does not "
    "matter",
    "harness.models.anchors.x_build_block_layout__mutmut_89": "anchor[a:b] = positions... copies into anchor, made on "
    "the documents' device: a slice assignment copies across devices, so where the right-hand side lives does not "
    "matter",
    "harness.models.anchors.x_build_block_layout__mutmut_88": "anchor[a:b] = positions... casts into anchor's int64 "
    "(positions are checked to be an integer dtype just above)",
    "harness.models.anchors.x_build_block_layout__mutmut_90": "anchor[a:b] = positions... casts into anchor's int64 "
    "(positions are checked to be an integer dtype just above)",
    "harness.models.anchors.x_build_block_layout__mutmut_106": "torch.repeat_interleave(repeats) is documented as "
    "repeat_interleave(arange(len(repeats)), repeats) on repeats' device, and blocks_per_doc is already int64 on the "
    "batch's device",
    "harness.models.anchors.xǁFlatDocumentsǁfrom_batch__mutmut_104": "torch.repeat_interleave(repeats) is documented "
    "as repeat_interleave(arange(len(repeats)), repeats) on repeats' device, and doc_lengths is already int64 on the "
    "batch's device",
    "harness.models.anchors.xǁFlatDocumentsǁfrom_batch__mutmut_69": "the fill of last (-1 or -2) is read only for a "
    "row without a real token, which raised just above; any other row's amax is a real column >= 0",
    "harness.models.anchors.x_sample_anchors__mutmut_26": "an invalid position's key 2.0 or 3.0 lies above every "
    "uniform key in [0, 1) and below the next document's offset 4.0: valid keys keep their order, and invalid ones "
    "are never taken (rank < the document's valid count)",
    "harness.models.drafter_inputs.x_anchor_candidates__mutmut_7": "astype's copy flag only decides whether a new "
    "array is allocated; the mask is only read",
    "harness.models.drafter_inputs.x_anchor_candidates__mutmut_9": "astype's copy flag only decides whether a new "
    "array is allocated; the mask is only read",
    "harness.models.drafter_inputs.x_anchor_candidates__mutmut_11": "astype's copy flag only decides whether a new "
    "array is allocated; the mask is only read",
    "harness.models.drafter_inputs.x_anchor_candidates__mutmut_13": "numpy's reshape takes any negative size as the "
    "one unknown dimension: reshape(-2) is reshape(-1)",
    "harness.models.drafter_inputs.x_document_anchors__mutmut_31": "np.zeros defaults to float64",
    "harness.models.drafter_inputs.x_document_anchors__mutmut_33": "np.zeros defaults to float64",
    "harness.models.drafter_inputs.x_document_anchors__mutmut_39": "at candidates.size == num_anchors, "
    "argsort(keys)[:num_anchors] is a permutation of every index and np.sort gives back 0..n-1: the same positions "
    "and keys",
    "harness.models.drafter_inputs.x_document_anchors__mutmut_47": "numpy reads the sort kind case-insensitively: "
    "kind=\"STABLE\" is the stable sort (checked on tied keys)",
    "harness.models.drafter_inputs.x_document_weight_sum__mutmut_4": "astype's copy flag only decides whether a new "
    "array is allocated; the mask is only read",
    "harness.models.drafter_inputs.x_document_weight_sum__mutmut_6": "astype's copy flag only decides whether a new "
    "array is allocated; the mask is only read",
    "harness.models.drafter_inputs.x_document_weight_sum__mutmut_8": "astype's copy flag only decides whether a new "
    "array is allocated; the mask is only read",
    "harness.models.drafter_inputs.x_document_weight_sum__mutmut_10": "numpy's reshape takes any negative size as the "
    "one unknown dimension: reshape(-2) is reshape(-1)",
    "harness.models.drafter_inputs.x_document_weight_sum__mutmut_18": "numpy's reshape takes any negative size as the "
    "one unknown dimension: reshape(-2) is reshape(-1)",
    "harness.models.drafter_inputs.x_document_weight_sum__mutmut_14": "anchors are integer positions "
    "(document_anchors' int64 arrays, as harness/train/batch.py passes them; an empty one returns 0.0 first): "
    "np.asarray keeps an integer dtype, and anchors + the int64 slots is int64 either way",
    "harness.models.drafter_inputs.x_document_weight_sum__mutmut_16": "anchors are integer positions "
    "(document_anchors' int64 arrays, as harness/train/batch.py passes them; an empty one returns 0.0 first): "
    "np.asarray keeps an integer dtype, and anchors + the int64 slots is int64 either way",
    "harness.models.drafter_inputs.x_document_weight_sum__mutmut_25": "np.arange of Python ints is numpy's default "
    "int64, and anchors are int64",
    "harness.models.drafter_inputs.x_document_weight_sum__mutmut_28": "np.arange of Python ints is numpy's default "
    "int64, and anchors are int64",
    "harness.models.drafter_inputs.x_document_weight_sum__mutmut_31": "astype(None) is astype(float64)",
    "harness.models.drafter_inputs.xǁDrafterInputsǁbuild__mutmut_57": "at candidates == max_blocks the cap keeps every "
    "block (kept all True, capped = 0): the same positions",
    "harness.models.drafter_inputs.xǁDrafterInputsǁbuild__mutmut_66": "numpy reads the sort kind case-insensitively: "
    "kind=\"STABLE\" is the stable sort (checked on tied keys)",
    "harness.models.drafter_inputs.xǁDrafterInputsǁbuild__mutmut_93": "the positions are document_anchors' int64 "
    "arrays: ascontiguousarray keeps int64 (and build_block_layout casts to int64 anyway)",
    "harness.models.drafter_inputs.xǁDrafterInputsǁbuild__mutmut_95": "the positions are document_anchors' int64 "
    "arrays: ascontiguousarray keeps int64 (and build_block_layout casts to int64 anyway)",
    "harness.models.drafter_inputs.xǁDrafterInputsǁfrom_layout__mutmut_16": "Tensor.to(None) returns the bool tensor "
    "unchanged, and bool * float32 decay promotes to the same float32 0 / decay values",
    "harness.models.anchors.xǁFlatDocumentsǁfrom_batch__mutmut_13": "cu keeps cu_seqlens' int32 (or int64): doc_starts "
    "and doc_lengths are cast with .long() when FlatDocuments is built, cu[1:] - cu[:-1] is exact in int32, and "
    "repeat_interleave takes int32 repeats",
    "harness.models.anchors.xǁFlatDocumentsǁfrom_batch__mutmut_15": "cu keeps cu_seqlens' int32 (or int64): doc_starts "
    "and doc_lengths are cast with .long() when FlatDocuments is built, cu[1:] - cu[:-1] is exact in int32, and "
    "repeat_interleave takes int32 repeats",
    "strategies.balance.x__lpt__mutmut_12": "numpy reads the sort kind by its first letter case-insensitively: kind='STABLE' is the stable sort "
    "(checked: np.argsort(..., kind='STABLE') keeps ties in order)",
    "strategies.balance.x__lpt__mutmut_19": "slot_costs and by_cost are 2-D, so np.take_along_axis's default axis=-1 is axis 1",
    "strategies.balance.x__lpt__mutmut_25": "filled as float64 holds small whole counts exactly: filled < grad_accum compares the same and rank * "
    "grad_accum + filled is a whole float stored into the int64 new_slot_of_old unchanged",
    "strategies.balance.x__lpt__mutmut_27": "filled as float64 (np.zeros default) holds small whole counts exactly: filled < grad_accum compares "
    "the same and rank * grad_accum + filled is a whole float stored into the int64 new_slot_of_old "
    "unchanged",
    "strategies.balance.x__lpt__mutmut_7": "slot_costs is always 2-D [steps, per_step], so np.argsort's default axis=-1 is axis 1",
    "strategies.balance.x__regroup_windows__mutmut_100": "numpy's reshape takes any negative size as the one unknown dimension, so reshape(-2, ...) is "
    "reshape(-1, ...) (checked on numpy 2.4.6)",
    "strategies.balance.x__regroup_windows__mutmut_116": "numpy's reshape takes any negative size as the one unknown dimension, so reshape(-2, ...) is "
    "reshape(-1, ...) (checked on numpy 2.4.6)",
    "strategies.balance.x__regroup_windows__mutmut_123": "numpy's reshape takes any negative size as the one unknown dimension, so reshape(-2, ...) is "
    "reshape(-1, ...) (checked on numpy 2.4.6)",
    "strategies.balance.x__regroup_windows__mutmut_13": "numpy's reshape takes any negative size as the one unknown dimension, so reshape(-2, ...) is "
    "reshape(-1, ...) (checked on numpy 2.4.6)",
    "strategies.balance.x__regroup_windows__mutmut_21": "windows and its argsort are 2-D, so np.take_along_axis's default axis=-1 is axis 1",
    "strategies.balance.x__regroup_windows__mutmut_26": "costs_with_empty[windows] is 2-D [num_windows, size * per_step], so np.argsort's default axis=-1 is "
    "axis 1",
    "strategies.balance.x__regroup_windows__mutmut_31": "numpy reads the sort kind by its first letter case-insensitively: kind='STABLE' is the stable sort",
    "strategies.balance.x__regroup_windows__mutmut_41": "numpy's reshape takes any negative size as the one unknown dimension, so reshape(-2, ...) is "
    "reshape(-1, ...) (checked on numpy 2.4.6)",
    "strategies.balance.x__regroup_windows__mutmut_46": "rng.random(regrouped.shape[:2]) is 2-D [num_windows, size], so np.argsort's default axis=-1 is axis "
    "1",
    "strategies.balance.x__regroup_windows__mutmut_70": "numpy's reshape takes any negative size as the one unknown dimension, so reshape(-2, ...) is "
    "reshape(-1, ...) (checked on numpy 2.4.6)",
    "strategies.balance.x__regroup_windows__mutmut_83": "numpy's reshape takes any negative size as the one unknown dimension, so reshape(-2, ...) is "
    "reshape(-1, ...) (checked on numpy 2.4.6)",
    "strategies.balance.x__regroup_windows__mutmut_91": "numpy's reshape takes any negative size as the one unknown dimension, so reshape(-2, ...) is "
    "reshape(-1, ...) (checked on numpy 2.4.6)",
    "strategies.balance.x__window_blocks__mutmut_6": "with complete == 0 the extra block (0, 0, window_steps) covers no step: _regroup_windows reshapes an "
    "empty slice, draws rng.random of size 0 (which does not advance the generator) and writes nothing; "
    "balance_slots only regroups with num_full_steps > 1 (checked on 3000 random cases, outputs and "
    "generator state equal)",
    "strategies.edges.x_expected_padded_slots__mutmut_24": "np.searchsorted's default side is 'left', so dropping side='left' finds the same bucket for every "
    "length",
    "strategies.epoch_plan.xǁPlanǁkept_indices__mutmut_3": "np.ones with dtype=None is a float64 mask of 1.0; setting entries to False stores 0.0 and "
    "np.flatnonzero(...).astype(np.int64) gives the same indices",
    "strategies.epoch_plan.xǁPlanǁkept_indices__mutmut_5": "np.ones without dtype is a float64 mask of 1.0; setting entries to False stores 0.0 and "
    "np.flatnonzero(...).astype(np.int64) gives the same indices",
    "strategies.epoch_plan.xǁPlanǁkept_indices__mutmut_6": "assigning None into a bool array stores False (np.bool_(None) is False), so keep[self.dropped] = "
    "None clears the same entries",
    "strategies.epoch_plan.xǁPlanǁremaining_indices__mutmut_3": "np.ones with dtype=None is a float64 mask of 1.0; setting entries to False stores 0.0 and "
    "np.flatnonzero(...).astype(np.int64) gives the same indices",
    "strategies.epoch_plan.xǁPlanǁremaining_indices__mutmut_5": "np.ones without dtype is a float64 mask of 1.0; setting entries to False stores 0.0 and "
    "np.flatnonzero(...).astype(np.int64) gives the same indices",
    "strategies.epoch_plan.xǁPlanǁremaining_indices__mutmut_6": "assigning None into a bool array stores False (np.bool_(None) is False), so keep[self.dropped] = "
    "None clears the same entries",
    "strategies.epoch_plan.xǁPlanǁremaining_indices__mutmut_8": "assigning None into a bool array stores False (np.bool_(None) is False), so keep[self.consumed] = "
    "None clears the same entries",
    "strategies.metrics.x__mean_step_kl__mutmut_17": "astype(None) converts to numpy's default float64, the same as astype(np.float64) (checked)",
    "strategies.metrics.x_length_mix_divergence__mutmut_10": "float('NAN') is the same NaN float as float('nan') (Python parses 'nan' case-insensitively; checked)",
    "strategies.metrics.x_length_mix_divergence__mutmut_21": "minlength is redundant: lengths is non-empty here and its maximum is >= every quantile edge, so "
    "searchsorted(side='right') puts it in bin len(edges) = num_bins - 1 and np.bincount(bins) already "
    "has num_bins entries",
    "strategies.metrics.x_length_mix_divergence__mutmut_7": "float('NAN') is the same NaN float as float('nan') (Python parses 'nan' case-insensitively; checked)",
    "strategies.metrics.x_plan_metrics__mutmut_104": "astype(None) converts to numpy's default float64, the same as astype(np.float64) (checked)",
    "strategies.metrics.x_plan_metrics__mutmut_171": "unreachable else branch: a plan with no micro-batch has zero steps and plan_metrics already raised "
    "ValueError at plan_rank_costs' reshape(0, -1) (checked), so slots.size >= 1 whenever this line runs",
    "strategies.metrics.x_plan_metrics__mutmut_173": "unreachable else branch: a plan with no micro-batch has zero steps and plan_metrics already raised "
    "ValueError at plan_rank_costs' reshape(0, -1) (checked), so slots.size >= 1 whenever this line runs",
    "strategies.metrics.x_plan_metrics__mutmut_210": "float('NAN') is the same NaN float as float('nan') (Python parses 'nan' case-insensitively; checked)",
    "strategies.metrics.x_plan_metrics__mutmut_218": "float('NAN') is the same NaN float as float('nan') (Python parses 'nan' case-insensitively; checked)",
    "strategies.metrics.x_plan_metrics__mutmut_226": "float('NAN') is the same NaN float as float('nan') (Python parses 'nan' case-insensitively; checked)",
    "strategies.metrics.x_plan_metrics__mutmut_234": "float('NAN') is the same NaN float as float('nan') (Python parses 'nan' case-insensitively; checked)",
    "strategies.metrics.x_plan_metrics__mutmut_251": "float('NAN') is the same NaN float as float('nan') (Python parses 'nan' case-insensitively; checked)",
    "strategies.metrics.x_plan_metrics__mutmut_31": "float('NAN') is the same NaN float as float('nan') (Python parses 'nan' case-insensitively; checked)",
    "strategies.metrics.x_plan_metrics__mutmut_52": "float('NAN') is the same NaN float as float('nan') (Python parses 'nan' case-insensitively; checked)",
    "strategies.metrics.x_plan_metrics__mutmut_57": "float('NAN') is the same NaN float as float('nan') (Python parses 'nan' case-insensitively; checked)",
    "strategies.metrics.x_plan_rank_blocks__mutmut_19": "numpy's reshape takes any negative size as the one unknown dimension, so reshape(steps, -2) is "
    "reshape(steps, -1), same shape and the same error for a zero-step plan (checked on numpy 2.4.6)",
    "strategies.metrics.x_plan_rank_costs__mutmut_23": "numpy's reshape takes any negative size as the one unknown dimension, so reshape(steps, -2) is "
    "reshape(steps, -1), same shape and the same error for a zero-step plan (checked on numpy 2.4.6)",
    "strategies.metrics.x_step_buckets__mutmut_13": "np.searchsorted's default side is 'left', so dropping side='left' finds the same bucket for every "
    "length",
    "strategies.metrics.x_step_buckets__mutmut_24": "an empty float64 bucket array instead of int64: segment_reduce casts values to int64 and, with no "
    "samples, returns its int64 zeros without reading them, so lowest/highest and the returned int64 "
    "steps are the same",
    "strategies.metrics.x_step_buckets__mutmut_26": "an empty float64 bucket array instead of int64: segment_reduce casts values to int64 and, with no "
    "samples, returns its int64 zeros without reading them, so lowest/highest and the returned int64 "
    "steps are the same",
    "strategies.metrics.x_step_buckets__mutmut_27": "this branch runs only when sample_indices is empty, so a plan's offsets are all 0, every segment is "
    "empty and segment_reduce returns zeros without reading the one-element bucket array (only a plan "
    "whose offsets point past its empty sample_indices could tell)",
    "strategies.metrics.x_step_mean_lengths__mutmut_4": "astype(None) converts to numpy's default float64, the same as astype(np.float64) (checked)",
    "strategies.metrics.x_step_of_positions__mutmut_4": "np.arange of a Python int with dtype=None gives numpy's default integer, int64 on numpy 2 (checked: "
    "np.arange(5).dtype is int64)",
    "strategies.metrics.x_step_of_positions__mutmut_6": "np.arange of a Python int without dtype gives numpy's default integer, int64 on numpy 2 (checked: "
    "np.arange(5).dtype is int64)",
    "strategies.metrics.x_step_spread__mutmut_12": "slice(None, k) and slice(0, k) select the same elements of the 1-D per-step arrays",
    "strategies.metrics.x_step_spread__mutmut_14": "slice(k) is slice(None, k), the same elements as slice(0, k) of the 1-D per-step arrays",
    "strategies.metrics.x_step_spread__mutmut_25": "astype(None) converts to numpy's default float64, the same as astype(np.float64) (checked)",
    "strategies.metrics.x_step_spread__mutmut_29": "float('NAN') is the same NaN float as float('nan') (Python parses 'nan' case-insensitively; checked)",
    "strategies.remainder.x_consumed_mask__mutmut_18": "array.dtype.kind is one character from 'biufcmMOSUV', never 'X', so it is in 'XXiuXX' exactly when "
    "it is in 'iu'",
    "strategies.remainder.x_plan_remainder__mutmut_92": "the sub-plan call without oversize= uses Strategy.plan's default oversize='error', the same value "
    "the code passes (no strategy overrides plan)",
    "strategies.validate.x__show__mutmut_3": "every caller passes an element of a numpy array whose dtype is not object (object arrays are "
    "converted first), i.e. always an np.generic, so the isinstance test is always true already",
    "strategies.slots.x_real_slots_first__mutmut_15": "per_rank is 3-D, so np.take_along_axis's default axis=-1 is axis 2 (numpy 2.4.6)",
    "strategies.slots.x_real_slots_first__mutmut_20": "per_rank < 0 is 3-D, so np.argsort's default axis=-1 is axis 2",
    "strategies.slots.x_real_slots_first__mutmut_26": "numpy reads the sort kind by its first letter case-insensitively: kind='STABLE' is the stable sort "
    "(checked: np.argsort(bool array, kind='STABLE') keeps ties in order)",
    "strategies.slots.x_token_slot_table__mutmut_19": "np.full with dtype=None takes the dtype of the fill value -1, a Python int: int64 on this 64-bit "
    "Linux numpy (checked: np.full((2, 3), -1, dtype=None).dtype == int64)",
    "strategies.slots.x_token_slot_table__mutmut_22": "np.full without dtype takes the dtype of the fill value -1, a Python int: int64 on this 64-bit Linux "
    "numpy (checked: np.full((2, 3), -1).dtype == int64)",
    "strategies.slots.x_token_slot_table__mutmut_32": "np.arange(n) of a Python int n is int64 on this 64-bit Linux numpy (checked: np.arange(5, "
    "dtype=None).dtype == int64), the same as dtype=np.int64",
    "strategies.slots.x_token_slot_table__mutmut_34": "np.arange(n) of a Python int n is int64 on this 64-bit Linux numpy (checked: np.arange(5, "
    "dtype=None).dtype == int64), the same as dtype=np.int64",
    "strategies.slots.x_token_slot_table__mutmut_38": "np.arange(n) of a Python int n is int64 on this 64-bit Linux numpy (checked: np.arange(5, "
    "dtype=None).dtype == int64), the same as dtype=np.int64",
    "strategies.slots.x_token_slot_table__mutmut_40": "np.arange(n) of a Python int n is int64 on this 64-bit Linux numpy (checked: np.arange(5, "
    "dtype=None).dtype == int64), the same as dtype=np.int64",
    "strategies.base.x_cut_token_steps__mutmut_4": "np.array([0, n]) of Python ints is int64 on this 64-bit Linux numpy (checked), the same as "
    "dtype=np.int64",
    "strategies.base.x_cut_token_steps__mutmut_6": "np.array([0, n]) of Python ints is int64 on this 64-bit Linux numpy (checked), the same as "
    "dtype=np.int64",
    "strategies.builtin.x_same_bucket_token_steps__mutmut_116": "np.arange(n) of a Python int n is int64 on this 64-bit Linux numpy (checked: np.arange(5, "
    "dtype=None).dtype == int64), the same as dtype=np.int64",
    "strategies.builtin.x_same_bucket_token_steps__mutmut_118": "np.arange(n) of a Python int n is int64 on this 64-bit Linux numpy (checked: np.arange(5).dtype == "
    "int64), the same as dtype=np.int64",
    "strategies.builtin.x_same_bucket_token_steps__mutmut_30": "minlength=counts.size is redundant: every micro-batch's bucket has at least one step, so the largest "
    "bucket id appears in step_bucket and bincount already has counts.size entries (empty input: both "
    "size 0)",
    "strategies.builtin.x_same_bucket_token_steps__mutmut_5": "bucket_offsets holds whole micro-batch counts (< 2**53), exact in float64; np.cumsum(out=) fills it "
    "the same and token_step_cuts only uses them as range bounds (checked: "
    "test_same_bucket_token_steps.py passes on the mutant with identical steps)",
    "strategies.builtin.x_same_bucket_token_steps__mutmut_54": "np.searchsorted's side defaults to 'left' (numpy docs; checked: same indices)",
    "strategies.builtin.x_same_bucket_token_steps__mutmut_7": "np.zeros's default dtype is float64: bucket_offsets holds whole micro-batch counts (< 2**53), exact "
    "in float64, used only as range bounds by token_step_cuts (checked: identical steps on the mutant)",
    "strategies.builtin.xǁBucketedStrategyǁtoken_steps__mutmut_14": "micro.info['edges'] is set by BucketedStrategy.micro_batches as edges.tolist() (Python ints), which "
    "np.asarray makes int64 with or without dtype; searchsorted on them is then the same",
    "strategies.builtin.xǁBucketedStrategyǁtoken_steps__mutmut_16": "micro.info['edges'] is set by BucketedStrategy.micro_batches as edges.tolist() (Python ints), which "
    "np.asarray makes int64 with or without dtype; searchsorted on them is then the same",
    "strategies.builtin.xǁBucketedStrategyǁtoken_steps__mutmut_25": "np.searchsorted's side defaults to 'left' (numpy docs; checked: same indices with and without "
    "side='left')",
    "strategies.builtin.xǁLengthGroupedStrategyǁmicro_batches__mutmut_18": "np.arange(n) of a Python int n is int64 on this 64-bit Linux numpy (checked: np.arange(5, "
    "dtype=None).dtype == int64), the same as dtype=np.int64",
    "strategies.builtin.xǁLengthGroupedStrategyǁmicro_batches__mutmut_20": "np.arange(n) of a Python int n is int64 on this 64-bit Linux numpy (checked: np.arange(5, "
    "dtype=None).dtype == int64), the same as dtype=np.int64",
    "strategies.builtin.xǁLengthGroupedStrategyǁmicro_batches__mutmut_39": "astype(None) is float64; group_offsets holds whole positions (< 2**53), exact in float64, and "
    "greedy_fill_padded only uses them as range bounds, writing int64 offsets itself (the suite's "
    "length_grouped plans are unchanged on the mutant)",
    "strategies.builtin.xǁLengthGroupedStrategyǁmicro_batches__mutmut_65": "np.arange(n) of a Python int n is int64 on this 64-bit Linux numpy (checked: np.arange(5, "
    "dtype=None).dtype == int64), the same as dtype=np.int64",
    "strategies.builtin.xǁLengthGroupedStrategyǁmicro_batches__mutmut_67": "np.arange(n) of a Python int n is int64 on this 64-bit Linux numpy (checked: np.arange(5, "
    "dtype=None).dtype == int64), the same as dtype=np.int64",
    "strategies.builtin.xǁPackedStrategyǁmicro_batches__mutmut_19": "max_rows only sizes the kernels' row arrays (max_bins, an upper bound; unused rows are never reached "
    "and new rows open lowest-index first), and 2*ceil(tokens/C)+2 already bounds the rows any-fit uses, "
    "so a larger bound packs the same rows (checked: test_packed_fit_choice.py packs with max_rows = n "
    "and matches the strategy for first and best fit)",
    "strategies.builtin.xǁPackedStrategyǁmicro_batches__mutmut_24": "max_rows only sizes the kernels' row arrays (max_bins, an upper bound; unused rows are never reached "
    "and new rows open lowest-index first), and 2*ceil(tokens/C)+2 already bounds the rows any-fit uses, "
    "so a larger bound packs the same rows (checked: test_packed_fit_choice.py packs with max_rows = n "
    "and matches the strategy for first and best fit)",
    "strategies.builtin.xǁShuffleStrategyǁmicro_batches__mutmut_23": "np.arange(n) of a Python int n is int64 on this 64-bit Linux numpy (checked: np.arange(5, "
    "dtype=None).dtype == int64), the same as dtype=np.int64",
    "strategies.builtin.xǁShuffleStrategyǁmicro_batches__mutmut_25": "np.arange(n) of a Python int n is int64 on this 64-bit Linux numpy (checked: np.arange(5, "
    "dtype=None).dtype == int64), the same as dtype=np.int64",
    "strategies.builtin.xǁSortedStrategyǁmicro_batches__mutmut_16": "numpy reads the sort kind by its first letter case-insensitively: kind='STABLE' is the stable sort "
    "(checked: test_sorted_ties_order.py, which fails on an unstable sort, passes on this mutant)",
    "strategies.cost.xǁCostModelǁmicro_batch_blocks__mutmut_11": "segment_reduce with dtype=None builds np.zeros(..., dtype=None) and values.astype(None), both "
    "float64 (checked), the same as dtype=np.float64",
    "strategies.cost.xǁCostModelǁmicro_batch_costs__mutmut_2": "ndarray.astype(None) is astype(float64) (checked: int64 and bool arrays .astype(None).dtype == "
    "float64)",
    "strategies.cost.xǁCostModelǁmicro_batch_costs__mutmut_23": "segment_reduce with dtype=None builds np.zeros(..., dtype=None) and values.astype(None), both "
    "float64 (checked), the same as dtype=np.float64",
    "strategies.cost.xǁCostModelǁmicro_batch_costs__mutmut_33": "segment_reduce with dtype=None builds np.zeros(..., dtype=None) and values.astype(None), both "
    "float64 (checked), the same as dtype=np.float64",
    "strategies.cost.xǁCostModelǁmicro_batch_costs__mutmut_9": "ndarray.astype(None) is astype(float64) (checked: np.where(...) int array .astype(None).dtype == "
    "float64)",
    "strategies.edges.x_expected_budget_slots__mutmut_21": "ndarray.astype(None) is float64; prefix holds whole sample counts (< 2**53), exact in float64, and "
    "bucket_fill_model only subtracts them and mixes them with floats (checked: 400 random cases give "
    "identical totals)",
    "strategies.edges.x_modelled_bucket_recurrence__mutmut_14": "prefix holds whole sample counts (< 2**53), exact in float64: the kernels only subtract and index "
    "with them, int() of the difference and pairable*(pairable-1.0) give the same numbers (checked: 400 "
    "random cases bit-identical)",
    "strategies.edges.x_modelled_bucket_recurrence__mutmut_80": "result is a list of Python floats from bucket_recurrence (0.0, 1.0 or a float quotient; an empty "
    "list too): np.asarray's default dtype for it is float64 (checked: np.asarray([]).dtype == float64)",
    "strategies.edges.x_modelled_bucket_recurrence__mutmut_82": "result is a list of Python floats from bucket_recurrence (0.0, 1.0 or a float quotient; an empty "
    "list too): np.asarray's default dtype for it is float64 (checked: np.asarray([]).dtype == float64)",
    "strategies.epoch_plan.xǁPlanǁexactly_once_violations__mutmut_15": "np.ones(dtype=None) is float64 (checked); expected holds 0/1 and counts are whole (< 2**53), so "
    "expected - counts and counts - expected are exact and int(...sum()) gives the same missing/repeated",
    "strategies.epoch_plan.xǁPlanǁexactly_once_violations__mutmut_17": "np.ones's default dtype is float64; expected holds 0/1 and counts are whole (< 2**53), so the "
    "differences are exact and int(...sum()) gives the same missing/repeated",
    "strategies.metrics.x_sample_micro_batch__mutmut_16": "np.arange(n) of a Python int n is int64 on this 64-bit Linux numpy (checked: np.arange(5, "
    "dtype=None).dtype == int64), the same as dtype=np.int64",
    "strategies.metrics.x_sample_micro_batch__mutmut_18": "np.arange(n) of a Python int n is int64 on this 64-bit Linux numpy (checked: np.arange(5, "
    "dtype=None).dtype == int64), the same as dtype=np.int64",
    "strategies.metrics.x_sample_micro_batch__mutmut_4": "np.full with no dtype takes the dtype of the fill value -1, a Python int: int64 on this 64-bit Linux "
    "numpy (checked: np.full((2, 3), -1).dtype == int64)",
    "strategies.metrics.x_sample_micro_batch__mutmut_7": "np.full with no dtype takes the dtype of the fill value -1, a Python int: int64 on this 64-bit Linux "
    "numpy (checked: np.full((2, 3), -1).dtype == int64)",
    "strategies.metrics.x__group_recurrence__mutmut_9": "first.size == 1 instead of == 0: one sample in both epochs has no pair, so "
    "pairs_first == 0 returns (nan, 0) a few lines on, as the early return does; with none, bincount of an empty array is "
    "empty and the same check returns (nan, 0)",
    "strategies.metrics.x__group_recurrence__mutmut_12": "float('NAN') is float('nan'): Python reads nan case-insensitively",
    "strategies.metrics.x__group_recurrence__mutmut_18": "first * G - second is as injective as first * G + second for second in "
    "[0, G): two keys meet only if (f - f') * G == s - s', and |s - s'| < G; so the same pairs share a key",
    "strategies.metrics.x__group_recurrence__mutmut_33": "float('NAN') is float('nan'): Python reads nan case-insensitively",
    "strategies.builtin.x__same_bucket_sequence__mutmut_8": "np.searchsorted's side defaults to 'left'",
    "strategies.builtin.xǁBucketedStrategyǁmicro_batches__mutmut_22": "np.searchsorted's side defaults to 'left'",
    "strategies.builtin.x__same_bucket_sequence__mutmut_42": "numpy reads any negative dimension of reshape as the one it infers "
    "(checked: np.arange(6).reshape(-2, 3).shape == (2, 3) on numpy 2.4)",
    "strategies.builtin.x__same_bucket_sequence__mutmut_57": "numpy reads any negative dimension of reshape as the one it infers "
    "(checked: np.arange(6).reshape(-2, 3).shape == (2, 3) on numpy 2.4)",
    "strategies.builtin.x__same_bucket_sequence__mutmut_65": "numpy reads any negative dimension of reshape as the one it infers "
    "(checked: np.arange(6).reshape(-2, 3).shape == (2, 3) on numpy 2.4)",
    "strategies.builtin.xǁBucketedStrategyǁ__post_init____mutmut_34": "explicit_edges(edges, longest=2) instead of 1: "
    "longest only closes the array it returns, which __post_init__ discards; the values it checks do not depend on it",
    "strategies.builtin.xǁBucketedStrategyǁmicro_batches__mutmut_31": "numpy reads argsort's kind case-insensitively (checked: "
    "kind='STABLE' sorts [1, 0, 1] stably to [1, 0, 2])",
}


def copy_project(work: Path) -> None:
    """The checkout's files as git sees them (tracked, and untracked but not ignored) in ``work``."""
    if work.exists():
        shutil.rmtree(work)
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, names):
        source = REPO / name
        if source.is_file():
            (work / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, work / name)


def mutmut_config(targets: list[str], work: Path) -> str:
    """The ``[tool.mutmut]`` table for the chosen targets."""
    only = [glob for name in targets for glob in TARGETS[name][0]]
    tests = [test for name in targets for test in TARGETS[name][1]]
    top = sorted(p.name for p in work.iterdir() if p.name not in SOURCE_PACKAGES and p.name != "tests")

    def toml_list(items: list[str]) -> str:
        return "[" + ", ".join(f'"{item}"' for item in items) + "]"

    return (
        "\n[tool.mutmut]\n"
        f"source_paths = {toml_list(SOURCE_PACKAGES)}\n"
        f"only_mutate = {toml_list(only)}\n"
        f"do_not_mutate = {toml_list(NOT_MUTATED)}\n"
        f"also_copy = {toml_list(top)}\n"
        f"pytest_add_cli_args_test_selection = {toml_list(tests)}\n"
        # no xdist in a mutant's run; torch is imported by the tests, so fork from a clean server
        f'pytest_add_cli_args = {toml_list(["-p", "no:xdist", "-p", "no:cacheprovider", "-q", "-x", *(f"--deselect={t}" for t in NOT_RUN)])}\n'
        'process_isolation = "forkserver"\n'
        "use_git_change_detection = false\n"
    )


def mutants_by_status(work: Path) -> dict[str, list[str]]:
    """``mutmut results --all true`` read into {status: [mutant name]}."""
    out = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], cwd=work, check=True,
                         capture_output=True, text=True).stdout
    by_status: dict[str, list[str]] = {}
    for line in out.splitlines():
        match = re.match(r"\s+(\S+): (.+)$", line)
        if match:
            by_status.setdefault(match.group(2).strip(), []).append(match.group(1))
    return by_status


def diff_of(work: Path, name: str) -> str:
    """The mutated line(s) of one mutant, from ``mutmut show``."""
    out = subprocess.run([sys.executable, "-m", "mutmut", "show", name], cwd=work, capture_output=True,
                         text=True).stdout
    changed = [line for line in out.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    return " / ".join(line.strip() for line in changed)


def target_of(name: str) -> str:
    """The target whose modules hold mutant ``name`` (``strategies.builtin.x_plan__mutmut_3`` -> ``strategies``)."""
    module = re.split(r"\.x(?:ǁ|_)", name, maxsplit=1)[0]
    path = module.replace(".", "/") + ".py"
    return next(target for target, (globs, _) in TARGETS.items() if any(fnmatch.fnmatch(path, g) for g in globs))


def target_section(target: str, names: dict[str, str], work: Path, command: str) -> str:
    """One target's section of RESULTS.md: its score, equivalent mutants with reasons, survivors with diffs."""
    statuses = [status for name, status in names.items()]
    survivors = sorted(name for name, status in names.items() if status in ("survived", "no tests"))
    equivalent = [name for name in survivors if name in EQUIVALENT]
    alive = [name for name in survivors if name not in EQUIVALENT]
    counted = [s for s in statuses if s not in ("skipped", "not checked")]
    killed = sum(s in ("killed", "timeout", "caught by type check", "segfault") for s in counted)
    scored = len(counted) - len(equivalent)
    score = killed / scored if scored else float("nan")
    globs, tests = TARGETS[target]
    lines = [
        f"{TITLE}: {target}", "",
        f"{command} Modules mutated: {', '.join(f'`{g}`' for g in globs)}"
        + (f" (not `{'`, `'.join(NOT_MUTATED)}`: numba compiles it, and mutmut's trampolines cannot run inside)"
           if target == "strategies" else "")
        + f"; their tests: {', '.join(f'`{Path(t).name}`' for t in tests)}"
        + f" (whole training runs deselected: {', '.join(f'`{t.split(chr(58))[-1]}`' for t in NOT_RUN)}).", "",
        f"**Score: {killed} of {scored} non-equivalent mutants killed, {score:.1%}** (goal ≥ {GOAL:.0%}: "
        f"{'PASS' if score >= GOAL else 'FAIL'}); {len(equivalent)} equivalent, {len(alive)} surviving "
        f"({sum(names[n] == 'no tests' for n in alive)} of them in code no selected test calls).", "",
    ]
    if equivalent:
        lines += ["Equivalent mutants (the code means the same):", ""]
        lines += [f"- `{name}`: {EQUIVALENT[name]}" for name in equivalent] + [""]
    if alive:
        lines += ["Surviving mutants:", ""]
        lines += [f"- `{name}` ({names[name]}): `{diff_of(work, name)}`" for name in alive] + [""]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=sorted(TARGETS), default=sorted(TARGETS))
    parser.add_argument("--work", type=Path, default=Path("/tmp/batchlab-mutation"))
    parser.add_argument("--max-children", type=int, default=2)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--resume", action="store_true",
                        help="continue a stopped run in --work (mutmut keeps each mutant's result there), on its copy")
    args = parser.parse_args()

    resumed = args.resume and (args.work / "mutants").is_dir()
    if not resumed:
        copy_project(args.work)
        with open(args.work / "pyproject.toml", "a") as fh:
            fh.write(mutmut_config(args.only, args.work))
    began = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", str(args.max_children)],
                         cwd=args.work)
    minutes = (time.monotonic() - began) / 60
    if run.returncode not in (0, 1):
        sys.exit(f"mutmut run failed with exit code {run.returncode}; its work folder: {args.work}")
    names = {name: status for status, group in mutants_by_status(args.work).items() for name in group}
    only = f" --only {' '.join(args.only)}" if args.only != sorted(TARGETS) else ""
    command = (f"Command: `python benchmarks/mutation_score.py{only} --write`; mutmut 3.8.1 (each mutant against the "
               f"selected tests that call its function), {args.max_children} children, {minutes:.1f} min for "
               f"{', '.join(args.only)}{' (the last leg of a stopped run, resumed with --resume)' if resumed else ''}."
               f" Machine: {cpu_model()}, {datetime.date.today().isoformat()}.")
    for target in args.only:
        section = target_section(target, {n: s for n, s in names.items() if target_of(n) == target}, args.work,
                                 command)
        print(section)
        if args.write:
            write_section(section, f"{TITLE}: {target}")


if __name__ == "__main__":
    main()
