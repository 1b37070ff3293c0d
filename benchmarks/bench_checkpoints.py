"""How the choice of a checkpoint scales, and what verified saves and loads cost over plain ones.

``./dev bench checkpoints [-- --counts 100,1000,10000 --store local|s3 --params 30K,4M --repeats 5]``

1. Choice: ``--counts`` checkpoints (one 1 KiB object and a manifest each)
   under one prefix of the chosen store (``local``: a directory; ``s3``: an
   in-process moto server). For each count it times
   ``select_checkpoint`` with the trusted step at the newest checkpoint and at
   the middle one (half the checkpoints passed over), counts the store
   requests it made, and times the approach it avoids (reading every
   manifest). Ratios: each count against the smallest, and "read every
   manifest" against the choice.
2. Save and load of a model of ``--params`` parameters with AdamW state
   (30K is the size of the reference job's model): the verified save
   (``sdcguard.agent.checkpoint.save_checkpoint``: sha256 of every object, RNG, manifest,
   pointer) against ``torch.save`` of the same state written plainly to files,
   and the verified load (sha256 of every object before ``torch.load``, state
   restored, fingerprint recomputed and compared) against reading the files
   and ``torch.load`` plainly. Both sides fsync, as the store does. The
   last two columns time the sha256 of the bytes and the state fingerprint
   alone: where the verified load's extra time goes.
"""

from __future__ import annotations

import argparse
import builtins
import io
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sdcguard.agent import fingerprint as fp
from sdcguard.agent.checkpoint import load_checkpoint, save_checkpoint
from sdcguard.contract.checkpoint import MANIFEST_NAME, CheckpointManifest, ObjectDigest, checkpoint_dir
from sdcguard.lineage.selection import select_checkpoint
from sdcguard.lineage.store import ObjectStore, open_store, sha256_hex
from sdcguard.lineage.verify import read_manifest

_SUFFIX = {"K": 1_000, "M": 1_000_000}


def _number(text: str) -> int:
    text = text.strip().upper()
    scale = _SUFFIX.get(text[-1:], 1)
    try:
        value = int(float(text[:-1] if text[-1:] in _SUFFIX else text) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a count: {text!r} (e.g. 1000, 30K, 4M)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def _numbers(text: str) -> list[int]:
    return [_number(p) for p in text.split(",") if p.strip()]


def _median(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class CountingStore(ObjectStore):
    """Delegates to a store and counts the requests made through it."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.calls = 0

    def _count(self) -> None:
        self.calls += 1

    def put_bytes(self, key: str, data: bytes, **kw: Any) -> str:
        self._count()
        return self.inner.put_bytes(key, data, **kw)

    def get_bytes(self, key: str) -> tuple[bytes, str]:
        self._count()
        return self.inner.get_bytes(key)

    def digest(self, key: str) -> tuple[str, int]:
        self._count()
        return self.inner.digest(key)

    def list(self, prefix: str = "") -> builtins.list[str]:
        self._count()
        return self.inner.list(prefix)

    def list_dirs(self, prefix: str) -> builtins.list[str]:
        self._count()
        return self.inner.list_dirs(prefix)

    def exists(self, key: str) -> bool:
        self._count()
        return self.inner.exists(key)

    def delete(self, key: str) -> None:
        self._count()
        self.inner.delete(key)

    def uri(self, key: str = "") -> str:
        return self.inner.uri(key)


@contextmanager
def _s3_client() -> Iterator[Any]:
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield boto3.client(
            "s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1",
            aws_access_key_id="bench", aws_secret_access_key="bench",
        )
    finally:
        server.stop()


def _fill(store: ObjectStore, count: int) -> None:
    """``count`` committed checkpoints, steps 100, 200, ...: one 1 KiB object and a manifest each."""
    for i in range(1, count + 1):
        step = 100 * i
        data = step.to_bytes(8, "little") * 128
        digest = ObjectDigest(name="model.pt", sha256=sha256_hex(data), size=len(data))
        manifest = CheckpointManifest(step=step, world_size=1, fingerprint=f"{step:048x}", objects=[digest])
        store.put_bytes(f"{checkpoint_dir(step)}/model.pt", data, sha256=digest.sha256)
        store.put_bytes(f"{checkpoint_dir(step)}/{MANIFEST_NAME}", manifest.model_dump_json().encode())


class _FastLocal:
    """Fills a local directory without the store's per-file fsync (set-up only, not measured)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def put_bytes(self, key: str, data: bytes, **_: Any) -> str:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return ""


def _choice_row(base: ObjectStore, count: int, repeats: int, requests: Callable[[], int]) -> tuple[float, ...]:
    """(newest s, middle s, requests of one choice, read-every-manifest s) for a filled store."""
    newest, middle = 100 * count, 100 * ((count + 1) // 2)
    t_newest = _median(lambda: select_checkpoint(base, newest), repeats)
    before = requests()
    assert select_checkpoint(base, middle).step == middle
    calls = requests() - before
    t_middle = _median(lambda: select_checkpoint(base, middle), repeats)

    def read_all() -> None:
        for d in base.list_dirs("checkpoints/"):
            read_manifest(base, int(d.rstrip("/").rsplit("-", 1)[1]))

    t_all = _median(read_all, max(1, repeats // 2) if count > 1000 else repeats)
    return t_newest, t_middle, float(calls), t_all


def bench_choice(counts: list[int], store_kind: str, repeats: int) -> None:
    """Part 1: the choice against the number of checkpoints under the prefix."""
    unit = "HTTP requests" if store_kind == "s3" else "store calls"
    print(f"choice of a checkpoint: store={store_kind}, median of {repeats}; requests = {unit} for one choice")
    print(f"{'checkpoints':>11}  {'newest ms':>9}  {'middle ms':>9}  {'requests':>8}  {'x vs first':>10}  "
          f"{'read-all ms':>11}  {'read-all / choice':>17}")
    first: float | None = None
    with tempfile.TemporaryDirectory() as tmp, (_s3_client() if store_kind == "s3" else _nothing()) as client:
        sent = [0]
        if client is not None:
            client.meta.events.register("before-send.s3", lambda **_: sent.__setitem__(0, sent[0] + 1))
        for count in counts:
            if client is not None:
                bucket = f"bench-{count}"
                client.create_bucket(Bucket=bucket)
                base: ObjectStore = open_store(f"s3://{bucket}/job", client=client)
                _fill(base, count)
                row = _choice_row(base, count, repeats, lambda: sent[0])
            else:
                root = Path(tmp, f"n{count}")
                _fill(_FastLocal(root), count)  # type: ignore[arg-type]
                counting = CountingStore(open_store(str(root)))
                row = _choice_row(counting, count, repeats, lambda c=counting: c.calls)  # type: ignore[misc]
            t_newest, t_middle, calls, t_all = row
            first = first or t_newest
            print(f"{count:>11}  {t_newest * 1e3:>9.2f}  {t_middle * 1e3:>9.2f}  {int(calls):>8}  "
                  f"{t_newest / first:>10.2f}  {t_all * 1e3:>11.1f}  {t_all / t_newest:>17.1f}")


@contextmanager
def _nothing() -> Iterator[Any]:
    yield None


def _model(params: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    width = max(8, int((params / 2) ** 0.5))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return model, opt


def _state_hex(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    tensors = [p.detach() for p in model.parameters()]
    for p in model.parameters():
        tensors += [v for _, v in sorted(opt.state[p].items()) if isinstance(v, torch.Tensor)]
    return fp.to_hex(fp.combine(fp.fingerprint_many(tensors)))


def _write_plain(folder: Path, name: str, data: bytes) -> None:
    with open(folder / name, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())


def _save_load_row(params: int, repeats: int, tmp: str) -> tuple[int, float, float, float, float, float, float, float]:
    """(parameters, MB, plain save, verified save, plain load, verified load, sha256, fingerprint) in seconds."""
    model, opt = _model(params)
    fingerprint = _state_hex(model, opt)
    plain_dir = Path(tmp, "plain")
    plain_dir.mkdir()
    store = open_store(str(Path(tmp, "job")))

    def plain_save() -> None:
        for name, state in (("model.pt", model.state_dict()), ("optimizer.pt", opt.state_dict())):
            buffer = io.BytesIO()
            torch.save(state, buffer)
            _write_plain(plain_dir, name, buffer.getvalue())

    def verified_save() -> None:
        save_checkpoint(store, 10, model=model, optimizer=opt, fingerprint=fingerprint, advance=False)

    def plain_load() -> None:
        model.load_state_dict(torch.load(plain_dir / "model.pt", weights_only=True))
        opt.load_state_dict(torch.load(plain_dir / "optimizer.pt", weights_only=True))

    def verified_load() -> None:
        load_checkpoint(store, model=model, optimizer=opt, step=10, fingerprint_fn=lambda: _state_hex(model, opt))

    t_ps = _median(plain_save, repeats)
    t_vs = _median(verified_save, repeats)
    t_pl = _median(plain_load, repeats)
    t_vl = _median(verified_load, repeats)
    blobs = [f.read_bytes() for f in plain_dir.iterdir()]
    # Where the verified load's extra time goes: hashing the bytes, and the fingerprint.
    t_sha = _median(lambda: [sha256_hex(b) for b in blobs], repeats)
    t_fp = _median(lambda: _state_hex(model, opt), repeats)
    size = sum(len(b) for b in blobs) / 1e6
    return sum(p.numel() for p in model.parameters()), size, t_ps, t_vs, t_pl, t_vl, t_sha, t_fp


def bench_save_load(sizes: list[int], repeats: int) -> None:
    """Part 2: verified save and load against plain ones of the same state."""
    print(f"\nsave and load (local directory, median of {repeats}; plain = torch.save bytes written to files)")
    print(f"{'params':>9}  {'MB':>7}  {'plain save ms':>13}  {'verified save ms':>16}  {'ratio':>6}  "
          f"{'plain load ms':>13}  {'verified load ms':>16}  {'ratio':>6}  {'sha256 ms':>9}  {'fingerprint ms':>14}")
    for params in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            n, size, t_ps, t_vs, t_pl, t_vl, t_sha, t_fp = _save_load_row(params, repeats, tmp)
        print(f"{n:>9}  {size:>7.2f}  {t_ps * 1e3:>13.1f}  {t_vs * 1e3:>16.1f}  {t_vs / t_ps:>6.2f}  "
              f"{t_pl * 1e3:>13.1f}  {t_vl * 1e3:>16.1f}  {t_vl / t_pl:>6.2f}  {t_sha * 1e3:>9.1f}  {t_fp * 1e3:>14.1f}")


def main(argv: list[str]) -> int:
    """Run both parts; returns the exit status."""
    parser = argparse.ArgumentParser(prog="bench checkpoints", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", type=_numbers, default=[100, 1000, 10000], help="checkpoints under the prefix")
    parser.add_argument("--store", choices=["local", "s3"], default="local", help="where the choice is measured")
    parser.add_argument("--params", type=_numbers, default=[30_000, 4_000_000], help="model sizes for save/load")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats: must be >= 1")
    torch.set_num_threads(1)
    bench_choice(args.counts, args.store, args.repeats)
    bench_save_load(args.params, args.repeats)
    return 0
