"""The admission policy shipped in infra/deploy/admission-policy.yaml, read as a cluster would take it: each
policy bound (Deny) to the guarded namespaces, matching what it must, every rule a CEL expression with a message,
and naming the identities and the taint the pipeline relies on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from sdcguard.lambdas.cordon import TAINT_KEY
from sdcguard.lambdas.node_check import SERVICE_ACCOUNT
from sdcguard.lambdas.resolve import REPLICA_INDEX_LABEL, REPLICA_TYPE_LABEL

ROOT = Path(__file__).resolve().parents[2]
DOCS = [d for d in yaml.safe_load_all((ROOT / "infra" / "deploy" / "admission-policy.yaml").read_text()) if d]
POLICIES = {d["metadata"]["name"]: d for d in DOCS if d["kind"] == "ValidatingAdmissionPolicy"}
BINDINGS = {d["spec"]["policyName"]: d for d in DOCS if d["kind"] == "ValidatingAdmissionPolicyBinding"}


def _text(policy: dict[str, Any]) -> str:
    spec = policy["spec"]
    return "\n".join([*(v["expression"] for v in spec.get("variables", [])), *(v["expression"] for v in spec["validations"])])


def _rules(policy: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, operation)
        for rule in policy["spec"]["matchConstraints"]["resourceRules"]
        for group in rule["apiGroups"] for resource in rule["resources"] for operation in rule["operations"]
    }  # fmt: skip


def test_every_policy_is_a_ga_policy_bound_to_deny_in_the_guarded_namespaces() -> None:
    assert {d["apiVersion"] for d in DOCS} == {"admissionregistration.k8s.io/v1"}
    assert set(POLICIES) == set(BINDINGS) == {"sdcguard-operator-pods", "sdcguard-node-check-jobs"}
    for name, policy in POLICIES.items():
        assert policy["spec"]["failurePolicy"] == "Fail", name  # an API server that cannot evaluate it refuses
        binding = BINDINGS[name]["spec"]
        assert binding["validationActions"] == ["Deny"], name
        assert binding["matchResources"]["namespaceSelector"] == {"matchLabels": {"sdcguard.io/guarded": "true"}}, name
        for validation in policy["spec"]["validations"]:
            assert validation["expression"].strip(), name
            assert validation["message"].strip(), name
            assert validation["reason"] == "Forbidden", name
        names = [v["name"] for v in policy["spec"].get("variables", [])]
        assert len(names) == len(set(names)), name
        for used in {w.split(".")[1].rstrip(")") for w in _text(policy).split() if w.startswith("variables.")}:
            assert used.split(".")[0] in names, (name, used)


def test_pods_with_the_operators_labels_or_owners_are_the_operators_and_none_is_pinned_or_tolerates_the_quarantine() -> None:
    policy = POLICIES["sdcguard-operator-pods"]
    assert _rules(policy) == {("", "pods", "CREATE"), ("", "pods", "UPDATE")}
    text = _text(policy)
    # the labels resolve believes (the operator's prefix covers the replica type and index) and the owners it reads
    assert "startsWith('training.kubeflow.org/')" in text
    assert REPLICA_TYPE_LABEL.startswith("training.kubeflow.org/")
    assert REPLICA_INDEX_LABEL.startswith("training.kubeflow.org/")
    assert "r.kind == 'PyTorchJob' || r.kind == 'Job'" in text
    assert "'system:serviceaccount:kubeflow:training-operator'" in text
    assert "'system:serviceaccount:kube-system:job-controller'" in text
    assert "object.spec.nodeName" in text
    assert "startsWith('system:node:')" in text
    assert f"t.key == '{TAINT_KEY}'" in text
    assert "(!has(t.key) || t.key == '') && has(t.operator) && t.operator == 'Exists'" in text  # tolerate-all


def test_only_the_pipelines_jobs_tolerate_the_quarantine_and_no_job_pins_its_pods() -> None:
    policy = POLICIES["sdcguard-node-check-jobs"]
    assert _rules(policy) == {("batch", r, o) for r in ("jobs", "cronjobs") for o in ("CREATE", "UPDATE")}
    text = _text(policy)
    assert "'sdcguard-pipeline' in request.userInfo.groups" in text
    assert f"t.key == '{TAINT_KEY}'" in text
    assert "variables.podSpec.nodeName" in text


def test_the_node_checks_account_is_shipped_without_an_api_token() -> None:
    (account,) = yaml.safe_load_all((ROOT / "infra" / "deploy" / "node-check-account.yaml").read_text())
    assert (account["kind"], account["metadata"]["name"]) == ("ServiceAccount", SERVICE_ACCOUNT)
    assert account["automountServiceAccountToken"] is False
