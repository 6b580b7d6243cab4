"""`flyspec bench`: Spec-Bench speed benchmark with peers, τ-limit analysis, tables and plots."""
