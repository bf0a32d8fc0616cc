"""The usage ledger's writer: records leave the request path at once and reach the database in
batches, and none is lost when the database is away.

``record()`` only appends to a list in the event loop. A background task writes what is pending
every ``flush_interval_s`` (sooner once ``max_batch`` records wait), in a thread, one
transaction per batch (``UsageStore.insert``). A batch that cannot be written goes to a spool
file on local disk (JSON lines, written to ``*.tmp``, fsynced, renamed: a file is complete or
absent); after the next successful write the spool is replayed, oldest first, and each file
unlinked once its records are in. Any replica replays any file, so what a replica that died
left behind is written by the next one. Two replicas replaying one file at once is harmless:
record ids are idempotent, and a file already unlinked is skipped.

Once a write has failed, every batch goes to the spool first, and the database is tried apart
(``_probe``: a replay, which writes the oldest file) until a write works again: a write to a
database that is away takes its connect timeout (5 s, 15 s on a kept connection), and the records
a flush held meanwhile were in memory only, a hard kill's to lose.

Not covered: records still in memory when the process is killed (at most ``flush_interval_s``
of them; ``aclose()`` flushes them on a clean stop, within ``CLOSE_WRITE_S``, then spools what
a slow database has not taken), and a spool directory that is not durable (give the routers a
volume for it).

The budget guard reads ``pending_tokens``: what this replica recorded and the database does
not have yet (pending, being written, or spooled), so a router sees its own spend at once.
"""

import asyncio
import json
import math
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path

from serve_app.usage.records import UnknownFields, UsageRecord
from serve_app.usage.store import UsageStore
from serve_app.telemetry.logs import module_logger

logger = module_logger(__name__)

SUFFIX = ".jsonl"
# With no traffic to write, the spool is still looked at this often: files a replica that died
# left behind (or this one's, spooled during an outage that ended quietly) are replayed.
IDLE_REPLAY_S = 30.0
# A stopping replica's last write waits this long for the database (a write under way may take a
# connect timeout and a statement's: 5 + 15 s, then the last flush as long again), then spools
# what is not known written: Serve kills a router ``ROUTER_DRAIN_S`` after its stop, which
# allows the ledger this and 5 s, and a record still in memory then is lost.
CLOSE_WRITE_S = 15.0
# A part-written spool file (``*.jsonl.tmp``) this old has no writer any more.
STALE_TMP_S = 600.0
# While the database is away, a disk that refused a batch is asked again this much later.
SPOOL_RETRY_S = 5.0


class UsageLedger:
    def __init__(
        self,
        store: UsageStore,
        spool_dir: Path,
        *,
        writer_id: str,
        flush_interval_s: float = 1.0,
        max_batch: int = 500,
    ):
        self.store = store
        self.spool_dir = Path(spool_dir)
        # Part of spool file names: anything but a plain name character becomes "_".
        self.writer_id = re.sub(r"[^A-Za-z0-9_.-]", "_", writer_id) or "writer"
        self.flush_interval_s = flush_interval_s
        self.max_batch = max_batch
        # Called in the loop with the tokens by key of every batch that reached the database
        # (the budget guard counts them in its running total from then on: BudgetGuard.written).
        self.on_written: Callable[[Mapping[str, int]], None] | None = None
        self.written = self.spooled = self.replayed = 0  # records, for ops
        self._pending: list[UsageRecord] = []
        self._writing: list[UsageRecord] = []  # the batch a flush took, until it is written or spooled
        self._unwritten: Counter[str] = Counter()  # tokens by key, until the database has them
        self._own_spool: dict[str, Counter[str]] = {}  # this writer's spool files -> their tokens
        # Spool files left for another router, by their size and mtime when left: one that has
        # not changed is not read again (a rollback's files would be re-parsed on every flush).
        self._held: dict[str, tuple[int, int] | None] = {}
        self._wakeup = asyncio.Event()
        self._closing = False
        self._closed = False  # the last flush is done: a later record is spooled as it comes
        self._task: asyncio.Task | None = None
        self._replayed_at = time.monotonic()
        self.database_away = False  # a write failed, and none has worked since
        self._replay_due = False  # the database is back: what was spooled meanwhile goes in now
        self._replaying = False
        self._spool_failed_at = -math.inf  # when the disk last refused a batch
        self._probe: asyncio.Task | None = None  # the database tried apart while it is away

    # --- the request path ---------------------------------------------------------------------
    def record(self, r: UsageRecord) -> None:
        """Queue ``r`` for writing. O(1), never blocks, never raises: it runs as a request ends."""
        if not isinstance(r, UsageRecord):  # a bug in the caller must not fail the response, nor the batch
            logger.error("usage ledger: not a UsageRecord (%s); dropped", type(r).__name__)
            return
        if self._closed:  # after the last flush (a replica stopping): to the spool at once, not lost
            self._spool_now([r])
            return
        self._pending.append(r)
        self._unwritten[r.key_id] += r.total_tokens
        if len(self._pending) >= self.max_batch:
            self._wakeup.set()

    def pending_tokens(self, key_id: str) -> int:
        return self._unwritten.get(key_id, 0)

    # --- the writer -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the writer; call from within the running event loop."""
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def aclose(self, within_s: float = CLOSE_WRITE_S) -> None:
        """Stop the writer and flush what is pending (to the database, or to the spool), for
        ``within_s`` at most. The writer is never cancelled mid-write (a thread's insert cannot be
        stopped, and a batch taken but not written would be lost): past the bound, what it has
        not written yet goes to the spool too, and the write goes on alone. A record both
        written and spooled is counted once (its id), when a router replays the file."""
        self._closing = True
        self._wakeup.set()
        if self._probe is not None:  # a replay under way goes on in its thread; its file is written or kept
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)  # the records it took are back
        writer = self._task if self._task is not None else asyncio.ensure_future(self._flush_logged())
        done, _ = await asyncio.wait({writer}, timeout=within_s)
        # Records that came while the last flush ran, or that it did not get to write: to the spool
        # with no await between, as any record from now on (``record``).
        self._closed = True
        late, self._pending = ([] if done else self._writing) + self._pending, []
        if not done:
            logger.warning("usage ledger: the database took more than %.0f s at close; spooling %d records",
                           within_s, len(late))
        if late:
            self._spool_now(late)

    async def _run(self) -> None:
        while not self._closing:
            try:
                await asyncio.wait_for(self._wakeup.wait(), self.flush_interval_s)
            except TimeoutError:
                pass
            self._wakeup.clear()
            await self._flush_logged()
        await self._flush_logged()  # what arrived while the last flush ran

    async def _flush_logged(self) -> None:
        try:
            await self.flush()
        except Exception:  # the writer must outlive anything (e.g. an unreadable spool directory)
            logger.exception("usage ledger: flush failed")

    async def flush(self) -> None:
        """Write everything pending, ``max_batch`` records per transaction; then, if that
        worked, replay the spool. A batch that fails is spooled (or, failing that, kept)."""
        batch, self._pending = self._pending, []
        if self.database_away:  # to the spool at once; the database is tried apart
            if time.monotonic() - self._spool_failed_at < SPOOL_RETRY_S:
                self._pending[:0] = batch  # the disk refused the last batch: held, not rewritten every second
            else:
                await self._spool_or_keep(batch)
            if not self._closing and (self._probe is None or self._probe.done()):
                self._probe = asyncio.get_running_loop().create_task(self._try_database())
            return
        self._writing = batch
        try:
            for start in range(0, len(batch), self.max_batch):
                if not await self._write(batch[start : start + self.max_batch]):
                    # The database is away: the rest need not wait for a timeout each.
                    await self._spool_or_keep(batch[start + self.max_batch :])
                    return
        finally:
            self._writing = []
        # Closing, the spool is left to the replicas that go on (a replay may be long).
        if not self._closing and (batch or self._replay_due or time.monotonic() - self._replayed_at > IDLE_REPLAY_S):
            await self._replay()

    async def _try_database(self) -> None:
        """While the database is away: replay the spool (its oldest file is the try), or, when no
        spooled record reached the database (the disk refused them, none could be read), write
        what is held in memory."""
        batch: list[UsageRecord] = []
        try:
            tried = await self._replay() if self._own_spool or not self._pending else False
            if not tried and self._pending:
                batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
                await self._write(batch)  # a failure spools or keeps them itself
                batch = []
            # Back: the files spooled while the try ran go in with the next flush, not 30 s later.
            self._replay_due = not self.database_away
        except asyncio.CancelledError:  # a stop: the records it took go back, to be spooled
            self._pending[:0] = batch
            raise
        except Exception:
            logger.exception("usage ledger: trying the database failed")

    async def _write(self, batch: list[UsageRecord]) -> bool:
        try:
            await asyncio.to_thread(self.store.insert, batch)
        except Exception as err:  # RegistryUnavailable, psycopg's and sqlite3's errors alike
            logger.warning(
                "usage ledger: writing %d records failed (%s: %s); spooling them", len(batch), type(err).__name__, err
            )
            self.database_away = True
            await self._spool_or_keep(batch)
            return False
        self.database_away = False
        self.written += len(batch)
        self._settle(_tokens_by_key(batch))
        return True

    def _spool_now(self, batch: list[UsageRecord]) -> None:
        """``batch`` to one spool file, on the loop (a replica stopping: nothing left to wait for)."""
        try:
            self._spool(batch)
            self.spooled += len(batch)
        except Exception as err:
            logger.error("usage ledger: %d records after close could not be spooled (%s); lost: %s",
                         len(batch), err, ", ".join(r.id for r in batch))

    async def _spool_or_keep(self, batch: list[UsageRecord]) -> None:
        if not batch:
            return
        try:
            name = await asyncio.to_thread(self._spool, batch)
        except Exception as err:  # the disk is full or read-only: hold them until a write succeeds
            self._spool_failed_at = time.monotonic()
            logger.error(
                "usage ledger: cannot spool %d records to %s (%s); keeping them in memory",
                len(batch), self.spool_dir, err,
            )
            self._pending[:0] = batch
            return
        self.spooled += len(batch)
        self._own_spool[name] = _tokens_by_key(batch)

    def _spool(self, batch: list[UsageRecord]) -> str:
        """Write ``batch`` to a new spool file atomically; return its name."""
        self.spool_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        stamp = time.time_ns()
        while (self.spool_dir / f"{self.writer_id}-{stamp}{SUFFIX}").exists():
            stamp += 1
        name = f"{self.writer_id}-{stamp}{SUFFIX}"
        tmp = self.spool_dir / f"{name}.tmp"
        try:
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as out:
                out.writelines(json.dumps(r.to_json()) + "\n" for r in batch)
                out.flush()
                os.fsync(out.fileno())
        except BaseException:  # a full disk: the part written is no file, and holds space the next try needs
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, self.spool_dir / name)
        _fsync_dir(self.spool_dir)  # the rename itself must survive a crash
        return name

    async def _replay(self) -> bool:
        """Replay the spool, oldest first; True when a file's records were put to the database
        (written or not). One replay at a time: asked during another, it is due with the next flush
        (two at once inserted the same files and told the budget guard their tokens twice)."""
        if self._replaying:
            self._replay_due = True
            return False
        self._replaying = True
        try:
            return await self._replay_files()
        finally:
            self._replaying = False

    async def _replay_files(self) -> bool:
        self._replayed_at, self._replay_due = time.monotonic(), False
        own_files = list(self._own_spool)  # before the listing: a file spooled during it is not "gone"
        names = await asyncio.to_thread(self._spool_files)
        if names is None:  # unlisted: this writer's own files, which it knows by name (none said gone)
            names = sorted(own_files, key=lambda n: (_stamp(n), n))
        self._held = {name: held for name, held in self._held.items() if name in names}  # gone: forgotten
        # This writer's files that are gone were replayed by another replica: they are written.
        for name in [n for n in own_files if n not in names and n in self._own_spool]:
            self._settle(self._own_spool.pop(name))
        tried = False
        for name in names:
            try:
                records = await asyncio.to_thread(self._replay_file, self.spool_dir / name)
            except _Held as held:  # left where it is; the files after it still go
                if held.why and name not in self._held:
                    logger.warning("usage ledger: leaving %s in the spool: %s", name, held.why)
                self._held[name] = held.signature
                continue
            except Exception as err:  # the database went away again: the rest waits for the next write
                logger.warning("usage ledger: replaying %s failed (%s: %s)", name, type(err).__name__, err)
                self.database_away = True
                return True
            if records is None:  # another replica replayed it first
                continue
            if records:  # none (every line corrupt) reached no database: it says nothing of one
                tried, self.database_away = True, False
            self.replayed += len(records)
            own = self._own_spool.pop(name, None)  # this writer's file: its tokens stop counting here
            self._settle(own if own is not None else _tokens_by_key(records), unwritten=own is not None)
            logger.info("usage ledger: replayed %d records from %s", len(records), name)
        return tried

    def _spool_files(self) -> list[str] | None:
        """Every writer's spool files, oldest first (by the time in their names); None when the
        spool cannot be listed (EMFILE, EIO): its files are not gone, only unseen this time."""
        try:
            listed = os.listdir(self.spool_dir)
        except FileNotFoundError:  # nothing was ever spooled
            return []
        except OSError as err:  # unusable (not a directory, no permission): spooling fails loudly too
            logger.warning("usage ledger: cannot list the spool %s (%s)", self.spool_dir, err)
            return None
        for name in (n for n in listed if n.endswith(SUFFIX + ".tmp")):
            self._sweep(self.spool_dir / name)
        names = [n for n in listed if n.endswith(SUFFIX)]
        return sorted(names, key=lambda n: (_stamp(n), n))

    @staticmethod
    def _sweep(tmp: Path) -> None:
        """Remove a part-written spool file whose writer is gone (killed mid-write: a write takes
        milliseconds), so the volume does not fill with them."""
        try:
            if time.time() - tmp.stat().st_mtime > STALE_TMP_S:
                tmp.unlink(missing_ok=True)
                logger.warning("usage ledger: removed %s, a spool file its writer never finished", tmp.name)
        except OSError:
            pass

    def _replay_file(self, path: Path) -> list[UsageRecord] | None:
        """Insert a spool file's records and unlink it; None if it is already gone."""
        try:
            info = path.stat()
        except FileNotFoundError:
            return None
        except OSError as err:  # not readable: no reason to keep the others waiting
            raise _Held(f"it cannot be read ({err})", None) from None
        signature = (info.st_size, info.st_mtime_ns)
        if self._held.get(path.name) == signature:
            raise _Held("", signature)  # left before, unchanged since: not read again
        try:
            lines = path.read_bytes().splitlines()  # decoded line by line: one bad byte spoils one line
        except FileNotFoundError:
            return None
        except OSError as err:  # not a file, not readable: no reason to keep the others waiting
            raise _Held(f"it cannot be read ({err})", signature) from None
        records, newer = [], 0
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                records.append(UsageRecord.from_json(json.loads(line.decode())))
            except UnknownFields:
                newer += 1
            except ValueError as err:  # json's and the decoder's errors are ValueErrors too
                logger.error("usage ledger: skipping corrupt line %d of %s (%s)", number, path.name, err)
        if newer:
            # Billed requests, not corrupt lines: deleted here, they were never billed. A router
            # of the release that wrote them replays the whole file (a record written twice is
            # written once: its id).
            raise _Held(f"{newer} of its records have fields this release does not know (a newer release "
                        "wrote them): a router of that release replays it", signature)
        self.store.insert(records)
        path.unlink(missing_ok=True)
        return records

    def _settle(self, tokens: Counter[str], unwritten: bool = True) -> None:
        """The database now has these tokens: stop counting them as this replica's own, and tell
        the budget guard to read them from there."""
        if unwritten:
            self._unwritten.subtract(tokens)
            for key_id in [k for k in tokens if self._unwritten[k] <= 0]:
                del self._unwritten[key_id]
        if self.on_written is not None and tokens:
            try:
                self.on_written(dict(tokens))
            except Exception:
                logger.exception("usage ledger: on_written failed")


class _Held(Exception):
    """A spool file this replica leaves where it is, going on with the next ones: ``why`` (empty
    when it was left before), and its size and mtime (None: unknown, read again next time)."""

    def __init__(self, why: str, signature: tuple[int, int] | None):
        super().__init__(why)
        self.why, self.signature = why, signature


def _tokens_by_key(records: list[UsageRecord]) -> Counter[str]:
    tokens: Counter[str] = Counter()
    for r in records:
        tokens[r.key_id] += r.total_tokens  # a key with 0 tokens is kept, so on_written names it
    return tokens


def _stamp(name: str) -> int:
    try:
        return int(name[: -len(SUFFIX)].rsplit("-", 1)[1])
    except (IndexError, ValueError):  # not one of ours: after every real spool file
        return 1 << 63


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
