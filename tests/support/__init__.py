"""The tests' shared helpers: training runs and their records (train), processes killed whole (process), the
analysis sweep shared between workers (analysis), the real files (real_files), and the ranks' test seam (rank_hook)."""
