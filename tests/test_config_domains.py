"""Every numeric key of `RunConfig` has a declared domain, checked when the config is built
(issue 18): wrong types, nan, ±inf, negatives, zero and absurdly large values, set through the
command line's override path on the tiny preset, either build by design (the `ACCEPTED` table)
or fail fast with one `ConfigError` naming the key — never another exception, never a hang.

The keys are generated from the dataclasses (`walk_fields`), so a new field is covered (and must
declare its domain) without touching this file."""

import threading

import pytest

from moetrain.cli import main
from moetrain.config import numeric_type, walk_fields
from moetrain.errors import ConfigError
from moetrain.presets import preset, resolve_config
from moetrain.train.config import RunConfig

BAD_VALUES = ["abc", "nan", "inf", "-inf", "-1", "0", str(10**18), "1e308"]
"""What every numeric key is tried with (1e308 only where the key is a float)."""

HUGE = (str(10**18), "1e308")
ACCEPTED: dict[str, tuple[str, ...]] = {
    # 0 means "off" / "none" / "never" / "only at the end" by design:
    "model.num_dense_layers": ("0",),
    "model.moe.shared_hidden": ("0",),
    "model.moe.lb_loss_weight": ("0", *HUGE),
    "model.moe.z_loss_weight": ("0", *HUGE),
    "model.moe.bias_update_rate": ("0", *HUGE),
    "model.mtp_depth": ("0",),  # no multi-token prediction
    "model.mtp_loss_weight": ("0", *HUGE),
    "optim.muon_momentum": ("0",),  # Muon without momentum
    "optim.betas": ("0",),
    "optim.lion_betas": ("0",),  # Lion with β1 = β2 = 0: signSGD
    "optim.weight_decay": ("0", *HUGE),
    "optim.grad_clip": ("0", *HUGE),
    "schedule.warmup_steps": ("0",),
    "schedule.min_lr_ratio": ("0",),
    "train.eval_every": ("0",),
    "checkpoint.save_every": ("0",),
    "checkpoint.keep_last": ("0",),
    "compute.loss_chunk_tokens": ("0",),
    "guard.max_consecutive_skips": ("0",),
    "logging.profile_wait": ("0",),
    "parallel.spill_factor": ("0",),
    "parallel.capacity_min_rows": ("0",),  # no floor
    "parallel.overlap_chunks": ("0",),  # off: the plain exchange
    "model.sliding_window": ("0",),  # no window: every block global
    "model.q_lora_rank": ("0",),  # MLA's queries projected directly (no query latent)
    "model.rope_scaling.mscale": ("0", *HUGE),  # unset, as transformers' null
    "model.rope_scaling.mscale_all_dim": ("0", *HUGE),
    "guard.skip_spike_sigma": ("0", *HUGE),
    "train.seed": ("0", str(10**18)),
    # Huge but finite coefficients are numerically absurd, not dangerous: nothing is sized by
    # them, and a run they blow up stops on its non-finite updates (guard.max_consecutive_skips).
    "model.norm_eps": HUGE,
    "model.rope_theta": HUGE,
    "model.rope_scaling.factor": HUGE,
    "model.rope_scaling.high_freq_factor": HUGE,
    "model.rope_scaling.beta_fast": HUGE,
    "model.rope_scaling.beta_slow": HUGE,
    "model.init_std": HUGE,
    "model.init_output_std": HUGE,
    "optim.lr": HUGE,
    "optim.eps": HUGE,
}
"""(key → the values of BAD_VALUES it accepts by design); every other (key, value) must fail."""

BASE = preset("tiny").to_dict()
NUMERIC = [info for info in walk_fields(RunConfig) if numeric_type(info.type)[0] is not None]


def _cases():
    for info in NUMERIC:
        kind, _, is_list = numeric_type(info.type)
        for value in BAD_VALUES:
            if value == "1e308" and kind is int:
                continue
            yield pytest.param(info.dotted, value, is_list, id=f"{info.dotted}={value}")


def _current(dotted: str):
    node = BASE
    for part in dotted.split("."):
        node = node[part]
    return node


def _build_within(seconds: float, override: str) -> BaseException | None:
    """resolve_config('tiny', [override]) in a thread: its exception (None if it built); fails
    the test when it does not return within `seconds`."""
    outcome: list[BaseException | None] = []

    def build():
        try:
            resolve_config("tiny", [override])
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 -- reported to the test
            outcome.append(e)

    worker = threading.Thread(target=build, daemon=True)
    worker.start()
    worker.join(seconds)
    assert outcome, f"--{override} did not finish validating within {seconds} s"
    return outcome[0]


def test_every_numeric_key_declares_a_domain():
    missing = [info.dotted for info in NUMERIC if info.domain is None]
    assert not missing, f"declare a domain (positive, non_negative, in_range) for {missing}"
    assert set(ACCEPTED) <= {info.dotted for info in NUMERIC}, "ACCEPTED names a key that is gone"


@pytest.mark.parametrize("dotted, value, is_list", list(_cases()))
def test_bad_value_is_refused_or_accepted_by_design(dotted, value, is_list):
    if is_list:  # each item of a list of numbers (as many as the preset has, at least one)
        current = _current(dotted)
        raw = "[" + ", ".join([value] * max(1, len(current) if isinstance(current, list) else 1)) + "]"
    else:
        raw = value
    error = _build_within(10.0, f"{dotted}={raw}")
    if value in ACCEPTED.get(dotted, ()):
        assert error is None, f"{dotted}={raw} is accepted by design, got {error!r}"
        return
    assert isinstance(error, ConfigError), f"{dotted}={raw} must raise ConfigError, got {error!r}"
    message = str(error)
    assert dotted in message and "\n" not in message, message


@pytest.mark.parametrize(
    "override",
    ["optim.lr=" + "9" * 400, "train.steps=" + "9" * 400, "train.steps=" + "9" * 5000, "optim.betas=[1e400, 0.9]"],
    ids=["float-400-digits", "int-400-digits", "int-5000-digits", "list-item-overflows"],
)
def test_numbers_past_every_float_and_int_are_config_errors(override):
    error = _build_within(10.0, override)
    assert isinstance(error, ConfigError), repr(error)
    assert override.split("=")[0] in str(error) and len(str(error)) < 6000


@pytest.mark.parametrize(
    "override, words",
    [
        ("--optim.lr=nan", ["optim.lr=nan", "finite positive number"]),
        ("--parallel.timeout_s=inf", ["parallel.timeout_s=inf", "seconds"]),
        (f"--train.steps={10**18}", [f"train.steps={10**18}", "at most 10^9"]),
        ("--optim.betas=[0.9, -inf]", ["optim.betas", "[0, 1)"]),
    ],
)
def test_cli_names_the_key_value_and_domain(capsys, tmp_path, override, words):
    assert main(["train", "tiny", "--run-dir", str(tmp_path / "run"), override, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err, err
    assert err.strip().count("\n") == 0, err  # one paragraph
    for word in words:
        assert word in err, (word, err)


def test_help_shows_each_domain(capsys):
    with pytest.raises(SystemExit) as exit_:  # argparse exits after printing --help
        main(["config", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "  optim.lr  (float) = 0.003; a finite positive number\n" in out
    assert "  train.steps  (int) = 300; a positive integer, at most 10^9\n" in out
