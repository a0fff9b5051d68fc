"""Adaptive depth for a loaded model from a calibration file and a bytes budget (`--adaptive FILE --budget B`).

Methods: "exit" (early exit on EMAD's entropy, or on the predicted KL to the final layer: ntio.policies.early_exit)
and "skip" (predictive skip, ntio.policies.layer_skip). Schedules for "exit": "per-token" (each token exits on its
own; positions a layer skipped are masked there) and "monotone" (the seed's D_t ≤ D_{t-1}). Measured
(benches/RESULTS.md, "Adaptive depth"): the monotone schedule lets one early exit cap every later token of the
sequence, so its budget does not transfer (SmolLM2 barely exits; on Qwen2.5-Coder-1.5B a few exits cap whole
windows, 0.70 of the bytes at x3.6 where the held-out tokens said 0.96); per-token exits leave K/V holes at the
layers they skip, which cost the KL signal more than entropy (its exits are shallower): per-token and entropy are
the defaults.
"""

from __future__ import annotations

import os

from ntio.decoding.self_draft import Calibration, fingerprint
from ntio.errors import OptionError
from ntio.policies.base import LoadPolicy
from ntio.policies.cosine_skip import CosineSkipPolicy
from ntio.policies.depth_profile import SIGNALS, DepthProfile
from ntio.policies.early_exit import EarlyExitPolicy, ExitSchedule, ExitSetting
from ntio.policies.layer_skip import PredictedSkipPolicy, SkipSetting

METHODS = ("exit", "skip")
SCHEDULES = ("per-token", "monotone")


def schedule_for(profile: DepthProfile, schedule: str) -> ExitSchedule:
    if schedule not in SCHEDULES:
        raise OptionError("exit_schedule", f"must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if schedule == "monotone":
        return ExitSchedule.for_profile(profile)
    return ExitSchedule.for_profile(profile, refresh_every=1, refresh_levels=len(profile.probes))


def adaptive_policy(llm, path: str | os.PathLike[str], budget: float, method: str = "exit",
                    schedule: str = "per-token", prompt_full_depth: bool = True, signal: str = "entropy"
                    ) -> LoadPolicy:
    """The policy reading about `budget` of the dense bytes per token (as measured on the calibration's held-out
    tokens) for `llm`. prompt_full_depth: False for teacher-forced scoring (every position decided)."""
    if method not in METHODS:
        raise OptionError("adaptive_method", f"must be one of {', '.join(METHODS)}, got {method!r}")
    cfg = llm.config
    calibration = Calibration.load(path, fingerprint(llm.engine, llm.tokenizer.vocabulary), cfg.d_model)
    profile = DepthProfile.from_calibration(calibration, str(path), cfg.n_layers, cfg.d_model)
    if method == "skip":
        return PredictedSkipPolicy(profile, SkipSetting.for_budget(profile, budget), prompt_full_depth)
    if signal not in SIGNALS:
        raise OptionError("exit_signal", f"must be one of {', '.join(SIGNALS)}, got {signal!r}")
    setting = ExitSetting.for_budget(profile, schedule_for(profile, schedule), signal, budget)
    return EarlyExitPolicy(profile, setting, calibration.heads, llm.engine.final_norm, prompt_full_depth)


def adaptive_report(policy: LoadPolicy) -> dict:
    """What an adaptive-depth policy did, for --json: the bytes fraction its decided tokens needed and its
    setting."""
    if isinstance(policy, CosineSkipPolicy):
        return {"method": "cosine", "threshold": policy.threshold, "reverted_share": policy.reverted_share(),
                "bytes_fraction": 1.0}
    if isinstance(policy, PredictedSkipPolicy):
        return {"method": "skip", "threshold": policy.setting.threshold, "bytes_fraction": policy.bytes_fraction(),
                "held_out": policy.setting.quality(policy.profile)}
    assert isinstance(policy, EarlyExitPolicy)
    depths = policy.depths
    return {"method": "exit", "signal": policy.setting.signal, "quantile": policy.setting.quantile,
            "bytes_fraction": policy.bytes_fraction(),
            "mean_depth": sum(depths) / len(depths) if depths else float(policy.profile.n_layers),
            "held_out_bytes_fraction": policy.setting.held_out_fraction(policy.profile)}
