"""The reference job's capsule factory rebuilds the model the job trains, from nothing but its environment."""

from __future__ import annotations

import pytest
import torch

from sdcguard.agent.capsule_replay import resolve_factory
from sdcguard.agent.testing import train
from sdcguard.infra.drill.runs import REPLAY_FACTORY


def test_the_drills_factory_rebuilds_the_model_its_ranks_train(monkeypatch: pytest.MonkeyPatch) -> None:
    # The capsules the agent writes carry no factory_args: the factory's defaults must be the job's model.
    monkeypatch.delenv(train.MODEL_SHAPE_ENV, raising=False)
    torch.manual_seed(0)
    trained = train.TinyGPT(*(getattr(train.JobShape(), f) for f in ("vocab", "dim", "heads", "layers", "seq",
                                                                      "dropout")))

    module, loss = resolve_factory(REPLAY_FACTORY)()

    assert loss is train.loss_fn
    rebuilt = module.state_dict()
    assert {k: v.shape for k, v in rebuilt.items()} == {k: v.shape for k, v in trained.state_dict().items()}
    module.load_state_dict(trained.state_dict(), strict=True)


def test_a_job_of_other_sizes_says_them_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    shape = train.JobShape(dim=16, layers=1, batch=3)
    monkeypatch.setenv(train.MODEL_SHAPE_ENV, train.shape_spec(shape))

    module, _ = train.replay_model()

    assert train.shape_spec(shape) == "dim=16,layers=1"  # batch and seed do not shape the model
    assert isinstance(module, train.TinyGPT)
    assert len(module.blocks) == 1
    assert module.tok.weight.shape == (64, 16)
    assert train.shape_spec(train.JobShape(seed=5)) == ""


@pytest.mark.parametrize(("value", "says"), [("width=3", "'width' is not one of"), ("dim=big", "dim='big' is not")])
def test_a_bad_shape_is_refused_naming_the_variable(value: str, says: str, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(train.MODEL_SHAPE_ENV, value)
    with pytest.raises(ValueError, match=train.MODEL_SHAPE_ENV) as refused:
        train.replay_model()
    assert says in str(refused.value)
    # and the command line refuses it before any rank starts.
    monkeypatch.setattr(train, "launch", lambda *a, **k: pytest.fail("a rank was started"))
    assert train.main(["--nproc", "2", "--steps", "1"]) == 2
    assert capsys.readouterr().err.startswith(f"sdcguard.agent.testing.train: error: {train.MODEL_SHAPE_ENV}: ")


def test_the_command_line_tells_its_ranks_the_sizes_it_trains(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(train.MODEL_SHAPE_ENV, "")  # the defaults (and restored after: main sets it)
    started: list[str] = []

    def launch(*args: object, **kwargs: object) -> list[int]:
        started.append(train.os.environ[train.MODEL_SHAPE_ENV])
        return [0, 0]

    monkeypatch.setattr(train, "launch", launch)

    assert train.main(["--nproc", "2", "--steps", "1", "--dim", "16"]) == 0

    assert started == ["dim=16"]
