"""The campaign's tables (text), and its picture: coverage against detection latency, one line per detector."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from sdcguard.campaign.faults import MODELS, PERSISTENCES
from sdcguard.campaign.outcome import SIZES, FaultOutcome, table

LABELS = {
    "none": "no detector",
    "loss_spike": "loss spike (baseline)",
    "mad": "MAD k=336 (baseline)",
    "nonfinite": "non-finite grads",
    "reduced_grad": "reduced-grad compare",
    "ring_audit": "ring audit",
    "weight_fingerprint": "weight fingerprints",
    "product_checks": "product checks",
    "all": "all sdcguard",
    "all_products": "all + product checks",
    "checkpoint_verify": "checkpoint verify",
}


def label(name: str) -> str:
    """The name a detector row is printed under."""
    return LABELS.get(name, name.replace("_", " "))


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"


def model_table(model: str, outcomes: list[FaultOutcome], rows: list[str]) -> str:
    """The text table of one fault model."""
    by_persistence = Counter(o.persistence for o in outcomes)
    sizes = Counter(o.size for o in outcomes)
    silent = sum(sizes[s] for s in SIZES)
    fired = sum(1 for o in outcomes if o.fired)
    head = (f"{model}: {MODELS.get(model, '')}\n"
            f"  {len(outcomes)} faults ({', '.join(f'{by_persistence[p]} {p}' for p in PERSISTENCES)}), "
            f"{fired} fired; benign {sizes['benign']}, silent {silent} "
            f"(catastrophic {sizes['catastrophic']}, visible {sizes['visible']}, tiny {sizes['tiny']})"
            + (f", loud {sizes['loud']}" if sizes["loud"] else ""))
    lines = [head,
             f"  {'detector':<24}{'caught':>9}{'cover':>7}{'catastr.':>10}{'visible':>9}{'tiny':>8}"
             f"{'localised':>11}{'lat.med':>9}{'lat.max':>9}{'rollback ok':>13}{'persist.':>10}{'on benign':>11}"]
    for row in table(outcomes, rows):
        med = "-" if row["latency_median"] is None else f"{row['latency_median']:g}"
        mx = "-" if row["latency_max"] is None else str(row["latency_max"])
        persist = f"{row['persistence_right']}/{row['persistence_judged']}" if row["persistence_judged"] else "-"
        lines.append(
            f"  {label(row['detector']):<24}{row['caught']:>4}/{row['silent']:<4}{_pct(row['caught'], row['silent']):>7}"
            + "".join(f"{row[f'{s}_caught']:>{w - 4}}/{row[f'{s}_total']:<3}" for s, w in
                      (("catastrophic", 10), ("visible", 9), ("tiny", 8)))
            + f"{row['localized']:>11}{med:>9}{mx:>9}{row['rollback_ok']:>13}{persist:>10}"
            f"{row['caught_benign']:>11}")
    return "\n".join(lines)


def persistence_table(outcomes: list[FaultOutcome], rows: list[str]) -> str:
    """Coverage of silent faults by fault model and persistence, for the combined detectors and the baselines."""
    shown = [r for r in ("all", "all_products", "checkpoint_verify", "loss_spike", "mad") if r in rows]
    short = {"all": "all sdcguard", "all_products": "all + products", "checkpoint_verify": "checkpoint verify",
             "loss_spike": "loss spike", "mad": "MAD k=336"}
    lines = [f"  {'model':<12}{'persistence':<14}{'faults':>7}{'silent':>8}"
             + "".join(f"{short[r]:>20}" for r in shown)]
    for model in dict.fromkeys(o.model for o in outcomes):
        for persistence in PERSISTENCES:
            group = [o for o in outcomes if o.model == model and o.persistence == persistence]
            if not group:
                continue
            silent = [o for o in group if o.silent]
            cells = []
            for r in shown:
                applies = any(r in o.detections for o in group)
                caught = sum(1 for o in silent if r in o.detections and o.detections[r].caught)
                cells.append(f"{caught}/{len(silent)}" if applies else "-")
            lines.append(f"  {model:<12}{persistence:<14}{len(group):>7}{len(silent):>8}"
                         + "".join(f"{c:>20}" for c in cells))
    return "\n".join(lines)


def own_step_rows(outcomes: list[FaultOutcome], rows: list[str]) -> list[dict[str, Any]]:
    """Per fault model and sdcguard configuration: of its silent faults, how many were caught at their own step
    (latency 0), caught later, missed while visible (above 1e-3, catastrophic included) or missed while tiny;
    its benign faults; the latency of the catches (median, max)."""
    out = []
    for model in dict.fromkeys(o.model for o in outcomes):
        mine = [o for o in outcomes if o.model == model]
        for name in rows:
            if name in ("none", "loss_spike", "mad") or not any(name in o.detections for o in mine):
                continue
            seen = [(o, o.detections[name]) for o in mine if o.silent and name in o.detections]
            caught = [d for _, d in seen if d.caught]
            latencies = sorted(d.latency for d in caught if d.latency is not None)
            out.append({
                "model": model, "detector": name, "faults": len(mine), "silent": len(seen),
                "own_step": sum(d.latency == 0 for d in caught),
                "later": sum(d.latency is not None and d.latency > 0 for d in caught),
                "missed_visible": sum(not d.caught and o.size in ("catastrophic", "visible") for o, d in seen),
                "missed_tiny": sum(not d.caught and o.size == "tiny" for o, d in seen),
                "localized": sum(d.localized for d in caught),
                "benign": sum(o.size == "benign" for o in mine),
                "latency_median": latencies[len(latencies) // 2] if latencies else None,
                "latency_max": latencies[-1] if latencies else None,
            })
    return out


def own_step_table(outcomes: list[FaultOutcome], rows: list[str]) -> str:
    """The text of :func:`own_step_rows`."""
    lines = [f"  {'model':<12}{'configuration':<24}{'silent':>7}{'own step':>10}{'later':>7}"
             f"{'missed visible':>16}{'missed tiny':>13}{'localised':>11}{'benign':>8}{'latency':>9}"]
    for row in own_step_rows(outcomes, rows):
        latency = "-" if row["latency_max"] is None else f"{row['latency_median']}/{row['latency_max']}"
        lines.append(f"  {row['model']:<12}{label(row['detector']):<24}{row['silent']:>7}{row['own_step']:>10}"
                     f"{row['later']:>7}{row['missed_visible']:>16}{row['missed_tiny']:>13}{row['localized']:>11}"
                     f"{row['benign']:>8}{latency:>9}")
    return "\n".join(lines)


def coverage_curve(outcomes: list[FaultOutcome], name: str, horizon: int,
                   sizes: tuple[str, ...] = SIZES) -> list[float]:
    """Fraction of the silent faults of ``sizes`` caught within 0..horizon steps by ``name``."""
    pool = [o for o in outcomes if o.size in sizes and name in o.detections]
    if not pool:
        return []
    out = []
    for budget in range(horizon + 1):
        caught = sum(1 for o in pool if o.detections[name].caught and (o.detections[name].latency or 0) <= budget)
        out.append(caught / len(pool))
    return out


def plot(outcomes: list[FaultOutcome], rows: list[str], horizon: int, path: Path, title: str) -> None:
    """coverage.png: two panels (all silent faults; the catastrophic and visible ones), one line per detector."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    compute = [o for o in outcomes if o.model not in ("checkpoint", "null")]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for ax, sizes, name in ((axes[0], SIZES, "every silent corruption"),
                            (axes[1], ("catastrophic", "visible"), "catastrophic and visible")):
        pool = sum(1 for o in compute if o.size in sizes)
        for row in rows:
            if row in ("none", "checkpoint_verify"):
                continue
            curve = coverage_curve(compute, row, horizon, sizes)
            if curve:
                style = "--" if row in ("loss_spike", "mad") else "-"
                ax.plot(range(len(curve)), [100 * c for c in curve], style, label=label(row), linewidth=1.8)
        ax.set_title(f"{name} (n={pool})")
        ax.set_xlabel("detection latency budget (steps after the fault's first step)")
        ax.grid(alpha=0.3)
        ax.set_ylim(0, 100)
    axes[0].set_ylabel("faults caught within the budget (%)")
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(loc="upper left", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def soak_lines(soak: dict[str, Any]) -> str:
    """The clean soak, in two lines."""
    flags = ", ".join(f"{k} {v}" for k, v in sorted(soak["flags"].items()))
    dropout = f"dropout {soak['dropout']}, " if soak.get("dropout") is not None else ""
    return (f"clean soak: {soak['rank_steps']:,} rank-steps ({soak['steps']:,} steps x {soak['world']} ranks, "
            f"{dropout}GuardConfig defaults) in {soak['seconds']:.0f} s\n"
            f"  sdcguard false alarms: {len(soak['alarms'])}; step flags: {flags or '-'}\n"
            f"  baselines on the same steps: loss spike fired {soak['baselines']['loss_spike']} times, "
            f"MAD k=336 named a rank on {soak['baselines']['mad']} steps")
