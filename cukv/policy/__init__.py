"""Defaults as data: tiles and strategy thresholds per kernel family (:mod:`cukv.policy.prefill`,
:mod:`cukv.policy.decode`), and the pure functions that read them. Evidence for each number: docs/tuning.md."""
