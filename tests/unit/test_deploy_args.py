"""``sdcguard deploy`` refuses bad input before touching anything; the package targets one interpreter."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pytest

from sdcguard.cli import main
from sdcguard.infra.deploy.cfn_yaml import load_template
from sdcguard.infra.deploy.deploy import (
    STANDIN_NODE_CHECK_FACTORIES,
    STANDIN_NODE_CHECK_IMAGE,
    TEMPLATE,
    DeployError,
    check_overrides,
    default_target,
    deploy,
    node_check_defaults,
    parse_overrides,
)
from sdcguard.infra.deploy.package import (
    LAMBDA_TARGET,
    Target,
    local_target,
    package_key,
    prune_cache,
    requirements,
)

if TYPE_CHECKING:
    import boto3


class NoAws:
    """A session that fails the test if deploy reaches for any client."""

    region_name = "us-east-1"

    def client(self, name: str, **_: Any) -> Any:
        raise AssertionError(f"deploy created a {name} client for refused input")


@pytest.fixture(scope="module")
def template() -> dict[str, Any]:
    return load_template(TEMPLATE)


def test_overrides_parse_key_value_pairs() -> None:
    assert parse_overrides(["A=1", "B=x=y", "C="]) == {"A": "1", "B": "x=y", "C": ""}


@pytest.mark.parametrize(("items", "message"), [(["A"], "expected Key=Value"), (["=1"], "expected"), (["A=1", "A=2"], "twice")])
def test_malformed_overrides_are_named(items: list[str], message: str) -> None:
    with pytest.raises(DeployError, match=message):
        parse_overrides(items)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"HyperPodClusterNme": "x"}, "unknown template parameter.*HyperPodClusterNme"),
        ({"CodeKey": "x.zip"}, "CodeKey: set by sdcguard deploy"),
        ({"Mode": "yolo"}, "Mode='yolo': must be one of normal, dry_run, cordon_only"),
        ({"CheckpointPrefix": "/jobs/a/"}, "CheckpointPrefix='/jobs/a/': does not match"),
        ({"MaxQuarantinedNodes": "lots"}, "MaxQuarantinedNodes='lots': not a number"),
        ({"ApprovalTimeoutSeconds": "1"}, "ApprovalTimeoutSeconds=1: below the minimum 2"),
        ({"TrainingRoleArn": "arn:aws:iam::123456789012:role/path/name"}, "TrainingRoleArn"),
    ],
)
def test_refused_overrides_name_the_parameter(template: dict[str, Any], overrides: dict[str, str], message: str) -> None:
    with pytest.raises(DeployError, match=message):
        check_overrides(template, overrides)


def test_good_overrides_pass(template: dict[str, Any]) -> None:
    check_overrides(
        template,
        {
            "HyperPodClusterName": "ml-cluster",
            "EksClusterName": "ml-eks",
            "CheckpointBucket": "my-ckpts",
            "CheckpointPrefix": "jobs/llama",
            "ReviewerEmail": "oncall@example.com",
            "Mode": "cordon_only",
            "TrainingRoleArn": "arn:aws:iam::123456789012:role/trainer",
        },
    )


@pytest.mark.parametrize(
    ("stack", "overrides", "message"),
    [
        ("9bad", {}, "stack name"),
        ("ok", {"Nope": "1"}, "unknown template parameter"),
        ("ok", {"Mode": "yolo"}, "must be one of"),
    ],
)
def test_deploy_refuses_before_creating_any_client(stack: str, overrides: dict[str, str], message: str) -> None:
    with pytest.raises(DeployError, match=message):
        # NoAws answers only what a refused deploy may touch (region_name), failing on any client.
        deploy(stack, overrides, session=cast("boto3.Session", NoAws()))


def test_cli_reports_a_refusal_as_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["deploy", "--stack-name", "s", "--parameter-overrides", "Mode=yolo"]) == 1
    assert "Mode='yolo': must be one of" in capsys.readouterr().err


def test_the_target_is_the_only_difference_between_aws_and_the_standin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    assert default_target() == LAMBDA_TARGET == Target("3.12", "arm64")
    assert default_target(architecture="x86_64") == Target("3.12", "x86_64")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:5000")
    assert default_target() == local_target()
    assert package_key(LAMBDA_TARGET, requirements()) != package_key(local_target(), requirements())


@pytest.mark.parametrize(("version", "arch"), [("3", "arm64"), ("3.12", "aarch64"), ("py3.12", "x86_64")])
def test_a_bad_target_is_refused(version: str, arch: str) -> None:
    with pytest.raises(ValueError, match=r"python_version|architecture"):
        Target(version, arch)


def test_the_package_carries_the_lambda_dependencies_but_not_boto3() -> None:
    names = {r.split("[")[0].split(">")[0].split("=")[0] for r in requirements()}
    assert {"pydantic", "aws-lambda-powertools", "kubernetes"} <= names
    assert "boto3" not in names
    assert not any("torch" in n for n in names)


def test_the_package_cache_keeps_the_most_recently_used_zips(tmp_path: Path) -> None:
    for i in range(9):
        zip_file = tmp_path / f"{i:032x}.zip"
        zip_file.write_bytes(b"zip")
        os.utime(zip_file, (1_000_000 + i, 1_000_000 + i))
    (tmp_path / "deps-x").mkdir()
    removed = prune_cache(tmp_path, keep=6)
    assert sorted(p.name for p in removed) == [f"{i:032x}.zip" for i in range(3)]
    assert sorted(p.name for p in tmp_path.glob("*.zip")) == [f"{i:032x}.zip" for i in range(3, 9)]
    assert (tmp_path / "deps-x").is_dir()


def test_the_standin_gets_a_node_check_image_and_its_simulated_faults_and_aws_never_does() -> None:
    # The stand-in runs no images and simulates faulty GPUs by injection: a new stack there gets both, said aloud.
    local: dict[str, str] = {}
    said = node_check_defaults(local, {}, local=True)
    assert local == {"NodeCheckImage": STANDIN_NODE_CHECK_IMAGE, "NodeCheckAcceptInjectedFaults": "true",
                     "NodeCheckFactories": STANDIN_NODE_CHECK_FACTORIES}  # fmt: skip
    assert said == [f"on the local stand-in: NodeCheckImage={STANDIN_NODE_CHECK_IMAGE}",
                    "on the local stand-in: NodeCheckAcceptInjectedFaults=true",
                    f"on the local stand-in: NodeCheckFactories={STANDIN_NODE_CHECK_FACTORIES}"]  # fmt: skip
    given = {"NodeCheckImage": "registry.example/r@sha256:" + "1" * 64}
    node_check_defaults(given, {}, local=True)
    assert given["NodeCheckImage"] == "registry.example/r@sha256:" + "1" * 64
    # On AWS nothing is filled in; an empty image is warned about, accepting injections refused.
    aws: dict[str, str] = {}
    no_factories, warning = node_check_defaults(aws, {}, local=False)
    assert aws == {}
    assert no_factories.startswith("warning: NodeCheckFactories is empty: every node check's replay will refuse")
    assert warning.startswith("warning: NodeCheckImage is empty: no node check will run")
    with pytest.raises(DeployError, match="NodeCheckAcceptInjectedFaults=true is for the local stand-in only"):
        node_check_defaults({"NodeCheckAcceptInjectedFaults": "true"}, {}, local=False)
    with pytest.raises(DeployError, match="for the local stand-in only"):  # kept from an earlier deploy
        node_check_defaults({}, {"NodeCheckAcceptInjectedFaults": "true"}, local=False)
    assert node_check_defaults({"NodeCheckFactories": "mypkg.model:replay"},
                               {"NodeCheckImage": given["NodeCheckImage"]}, local=False) == []  # fmt: skip
