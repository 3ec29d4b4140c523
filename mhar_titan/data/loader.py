"""Train and validation loaders (the builders of docs/ARCHITECTURE.md).

Loader state and resuming
-------------------------
``TrainLoader.state_dict()`` holds the ``StatefulDataLoader`` state (every
worker's stream: epoch, shard position, shuffle buffer and RNG, partial token
buffer) plus the layout it was saved with (sharding, dp world size and rank,
local batch size, seq_len, workers, seed, shard names) and, in ``window`` mode,
``windows_done`` (global windows consumed) with a copy of the global stream at
that point. ``load_state_dict`` applies these rules:

- same layout: the loader continues exactly (also with workers);
- ``window`` mode at another dp world size, local batch size or worker count:
  continues exactly at global window ``windows_done`` (no window seen twice or
  skipped). The global stream is identical on every rank, so any rank's saved
  state can be loaded by any new rank;
- ``document`` mode at another world size or worker count: raises
  ``DataStateError`` naming the saved and current world sizes, unless
  ``data.allow_document_reshard`` is true, which starts epoch E+1 (E = the saved
  epoch) at the new layout and logs that the rest of epoch E is skipped;
- a different seq_len, seed, sharding mode or list of shards always raises.

A mixture (``data.sources``) saves every source's stream state under its name inside each
stream state (``mixture.MixtureStream``), its normalised weights and each source's shards in
the layout; the rules above hold for it unchanged (window mode at another layout continues the
global mixture stream at ``windows_done``; document mode with ``allow_document_reshard`` starts
every source's next epoch). Other sources (names or files) always raise; other weights raise
unless ``data.allow_weight_change`` is set, which continues every source from its saved
position with the new weights (window mode: from the global stream at ``windows_done``).

Finite data (``infinite = false``) and unused tokens per epoch
--------------------------------------------------------------
With ``L = seq_len + 1`` tokens per window and ``B = local_batch_size``:

- ``window`` mode: every rank stops at the same step; the epoch drops its last
  incomplete round (< ``dp_world * B`` windows) and partial window, so fewer than
  ``dp_world * B * L`` tokens are unused.
- ``document`` mode: rank r owns ``T_r`` tokens of the epoch (its documents plus one EOS
  each) and alone could fill ``s_r`` batches (per worker stream: one partial window and
  an incomplete batch dropped, < ``B * L`` tokens). To keep ranks in step, so that no
  rank waits in a collective for one that ran out, every rank stops after
  ``s = min_r s_r`` batches (``TrainLoader.epoch_batches`` lists the ``s_r``; computed
  at build time from the shards: pretokenized data reads only its row offsets, text
  data is tokenized once more, counted and discarded). Tokens unused per epoch:
  ``sum_r T_r - dp_world * s * B * L <= sum_r (T_r - T_min) + dp_world * W * (B * L - 1)``
  (W = workers per rank, at least 1). The imbalance ``T_r - T_min`` comes from
  ``split_parts``: whole shards go round-robin (no imbalance when shards have equal
  size) and each of the ``n_shards mod dp_world`` leftover shards is split by row
  striding, where ranks differ by at most one document. With equal-size shards of
  equal documents of D tokens that is at most ``(n_shards mod dp_world) * (D + 1)``
  tokens per rank, i.e. about one document per leftover shard. The batches a rank
  skips are logged when it stops. A finite run must therefore stop within
  ``min(epoch_batches)`` loader batches (``training.steps * gradient accumulation``);
  the default ``infinite = true`` never stops and drops nothing (the token buffer
  carries across epochs).
"""
import contextlib
import logging
import os
import signal
import threading
from typing import Optional

import numpy as np
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from mhar_titan.data.balance import epoch_batches_per_rank
from mhar_titan.config.data import DataConfig
from mhar_titan.data.dataset import DataFault, PackedBatches
from mhar_titan.data.manifest import check_tokenizer
from mhar_titan.data.mixture import FINITE_DOCUMENT_MIXTURE, NO_VALIDATION_SOURCE
from mhar_titan.data.sources import DataError, sources_fingerprint, train_shards, validation_shards
from mhar_titan.data.stream import TokenStream
from mhar_titan.errors import UserError

logger = logging.getLogger(__name__)
STATE_FORMAT = 2  # 2: stream pending tokens and shuffle buffer as per-document entries


# Stop signals the training process handles (finish the step, save, exit 0: mhar_titan.preemption).
# SLURM, scancel and torchrun deliver them to the whole process group and Ctrl-C to the terminal's
# foreground group, so loader workers receive them too. Workers ignore them: they must keep serving
# batches until the training process has finished its step, and it shuts them down itself. A SIGTERM
# from the worker's parent (its shutdown, or multiprocessing's at interpreter exit) still ends it.
WORKER_IGNORED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def _worker_ignores_stop_signals(worker_id: int) -> None:
    """``worker_init_fn`` (the worker was forked with ``WORKER_IGNORED_SIGNALS`` blocked): ignore
    SIGINT and SIGUSR1 (discarding any that arrived while it started) and unblock them; SIGTERM stays
    blocked and a thread takes it with ``sigwaitinfo``, exiting only when the parent sent it."""
    others = [sig for sig in WORKER_IGNORED_SIGNALS if sig != signal.SIGTERM]
    for sig in others:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, others)
    threading.Thread(target=_exit_on_sigterm_from, args=(os.getppid(),), name="loader-worker-sigterm",
                     daemon=True).start()


def _exit_on_sigterm_from(parent: int) -> None:
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
            os._exit(0)


@contextlib.contextmanager
def _stop_signals_held():
    """Block ``WORKER_IGNORED_SIGNALS`` in this thread while loader workers are forked, so a signal
    sent to the process group then cannot kill a worker before it ignores it; the training process
    gets any held signal when the block ends."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, WORKER_IGNORED_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class DataStateError(UserError, ValueError):
    """A saved loader state that cannot continue in this run (the message says why and what to do)."""


def _check_pretokenized(cfg: DataConfig, shards: list, tokenizer) -> None:
    for origin in dict.fromkeys(s.origin for s in shards if hasattr(s, "origin")):
        check_tokenizer(origin, tokenizer)


class TrainLoader:
    """Iterable of ``(inputs, labels)`` int64 ``(local_batch_size, seq_len)`` with resumable state.

    ``epoch_batches``: in finite document mode on several ranks, the batches each rank's epoch
    holds (index = rank; None otherwise); every rank stops after ``steps_every_rank_reaches``
    = their minimum (module docstring), so a trainer can check its step count up front.
    """

    def __init__(self, cfg: DataConfig, shards: list, tokenizer, *, dp_rank: int, dp_world: int,
                 local_batch_size: int, seq_len: int, seed: int):
        """``shards``: the training shards, or for a mixture one list per source (``cfg.mixture()`` order)."""
        self.cfg, self.shards, self.tokenizer = cfg, shards, tokenizer
        specs = cfg.mixture()
        self.mixture = ([m.name for m in specs], [m.weight for m in specs]) if specs else None
        fingerprint = ({name: sources_fingerprint(s) for name, s in zip(self.mixture[0], shards)} if specs
                       else sources_fingerprint(shards))
        self.layout = {"sharding": cfg.sharding, "dp_world": dp_world, "dp_rank": dp_rank,
                       "local_batch_size": local_batch_size, "seq_len": seq_len,
                       "num_workers": cfg.num_workers, "seed": seed, "sources": fingerprint}
        if specs:
            self.layout["weights"] = dict(zip(*self.mixture))
        self._source_windows = np.zeros(len(specs), dtype=np.int64)  # rows per source since take_source_windows
        self._windows_base = 0  # global windows consumed before this loader's first step (window mode)
        self._steps = 0         # batches yielded by this loader since it was built or loaded
        self._batches_base = 0  # batches yielded before that since the start of the current layout's first epoch
        self._build()

    def _build(self, start_stream: Optional[dict] = None, start_epoch: int = 0) -> None:
        lay = self.layout
        self._start_stream, self._first_epoch = start_stream, start_epoch
        self.epoch_batches: Optional[list[int]] = None
        if lay["sharding"] == "document" and not self.cfg.infinite and lay["dp_world"] > 1:
            if self.mixture is not None:
                raise DataError(FINITE_DOCUMENT_MIXTURE)
            self.epoch_batches = epoch_batches_per_rank(
                self.shards, self.tokenizer.encode, dp_world=lay["dp_world"], num_workers=self.cfg.num_workers,
                local_batch_size=lay["local_batch_size"], seq_len=lay["seq_len"], seed=lay["seed"],
                shuffle=self.cfg.shuffle, epoch=start_epoch)
            logger.info("data: finite document-mode epoch %d: batches per rank %s; every rank stops after %d",
                        start_epoch, self.epoch_batches, min(self.epoch_batches))
        self.dataset = PackedBatches(
            self.shards, self.tokenizer, sharding=lay["sharding"], dp_rank=lay["dp_rank"], dp_world=lay["dp_world"],
            local_batch_size=lay["local_batch_size"], seq_len=lay["seq_len"], seed=lay["seed"],
            shuffle=self.cfg.shuffle, shuffle_buffer=self.cfg.shuffle_buffer, infinite=self.cfg.infinite,
            start_stream=start_stream, start_epoch=start_epoch, mixture=self.mixture)
        kwargs = {}
        if self.cfg.num_workers > 0:
            kwargs = {"persistent_workers": False, "prefetch_factor": self.cfg.prefetch_factor,
                      "worker_init_fn": _worker_ignores_stop_signals, "multiprocessing_context": "fork"}
        # Its own generator: each iterator draws a base seed from it, which would otherwise be a draw
        # from torch's global RNG and shift the training's random stream at every (re)start.
        self._loader = StatefulDataLoader(self.dataset, batch_size=None, num_workers=self.cfg.num_workers,
                                          pin_memory=self.cfg.pin_memory and torch.cuda.is_available(),
                                          generator=torch.Generator().manual_seed(lay["seed"]), **kwargs)

    @property
    def round_size(self) -> int:
        return self.layout["dp_world"] * self.layout["local_batch_size"]

    @property
    def windows_done(self) -> int:
        """Global windows consumed by all ranks together (window mode)."""
        return self._windows_base + self._steps * self.round_size

    @property
    def batches_done(self) -> int:
        """Batches this rank has yielded since the start of its layout's first epoch (persisted in the state)."""
        return self._batches_base + self._steps

    @property
    def steps_every_rank_reaches(self) -> Optional[int]:
        """Finite document mode on several ranks: the batches every rank yields (then all stop); else None."""
        return min(self.epoch_batches) if self.epoch_batches else None

    def __iter__(self):
        limit, rank = self.steps_every_rank_reaches, self.layout["dp_rank"]
        with _stop_signals_held():  # workers are forked here (num_workers > 0)
            it = iter(self._loader)
        while limit is None or self.batches_done < limit:
            try:
                batch = next(it)
            except StopIteration:
                if limit is not None:
                    raise DataError(f"internal: rank {rank}'s finite document-mode data ended after "
                                    f"{self.batches_done} batches, expected {limit}") from None
                logger.info("data: rank %d's finite data ran out after %d batches; set data.infinite = true to "
                            "train longer", rank, self.batches_done)
                return
            if isinstance(batch, DataFault):
                raise DataError(batch.message)
            if self.mixture is not None:
                *batch, sources = batch
                self._source_windows += np.bincount(sources.numpy(), minlength=len(self._source_windows))
                batch = tuple(batch)
            self._steps += 1
            yield batch
        logger.warning(
            "data: rank %d stops after batch %d, the number every rank reaches in this finite document-mode "
            "epoch (batches per rank: %s; this rank leaves %d unused to keep ranks in step). Set data.infinite = "
            "true to train longer, or keep training.steps x gradient accumulation <= %d.", rank, limit,
            self.epoch_batches, self.epoch_batches[rank] - limit, limit)

    @property
    def source_names(self) -> Optional[list[str]]:
        """The mixture's source names (None for one source)."""
        return None if self.mixture is None else list(self.mixture[0])

    def take_source_windows(self) -> Optional[list[int]]:
        """Windows (batch rows) of each source this rank's loader yielded since the last call, in
        ``source_names`` order; None for one source."""
        if self.mixture is None:
            return None
        out, self._source_windows = self._source_windows.tolist(), np.zeros_like(self._source_windows)
        return out

    # -- state -----------------------------------------------------------------
    def _worker_states(self, loader_state: dict) -> list[dict]:
        if "_snapshot" in loader_state:
            snaps = loader_state["_snapshot"]["_worker_snapshots"].values()
            return [s["dataset_state"] for s in snaps if s.get("dataset_state")]
        return [loader_state["dataset_state"]] if loader_state.get("dataset_state") else []

    def _global_stream_at(self, loader_state: dict, window: int) -> Optional[dict]:
        """The window-mode global stream state at ``window`` (the worker that produced the last batch)."""
        if self._steps == 0:
            return self._start_stream
        for ws in self._worker_states(loader_state):
            if ws["stream"] is not None and ws["stream"]["window"] == window:
                return ws["stream"]
        raise DataError(f"internal: no worker stream state at global window {window}")

    def state_dict(self) -> dict:
        loader_state = self._loader.state_dict()
        sd = {"format": STATE_FORMAT, **self.layout, "steps": self._steps, "batches_done": self.batches_done,
              "first_epoch": self._first_epoch, "loader": loader_state,
              "epoch": max([ws["stream"]["epoch"] for ws in self._worker_states(loader_state)
                            if ws["stream"] is not None] or [0])}
        if self.mixture is not None:  # each source's highest epoch over this rank's workers
            streams = [ws["stream"] for ws in self._worker_states(loader_state) if ws["stream"] is not None]
            sd["epochs"] = {name: max([st["epochs"][name] for st in streams] or [0]) for name in self.mixture[0]}
        if self.layout["sharding"] == "window":
            sd["windows_done"] = self.windows_done
            sd["global_stream"] = self._global_stream_at(loader_state, self.windows_done)
        return sd

    def load_state_dict(self, sd: dict) -> None:
        """Restore a position saved by ``state_dict`` (rules in the module docstring).

        Raises DataStateError for a state this run cannot continue exactly.
        """
        if sd.get("format") != STATE_FORMAT:
            raise DataStateError(f"data-loader state format {sd.get('format')!r}, expected {STATE_FORMAT}")
        lay = self.layout
        self._check_mixture_state(sd)
        reweighted = self.mixture is not None and sd["weights"] != lay["weights"]
        for key, fix in (("sharding", "set data.sharding back"), ("seq_len", "resume with the same training.seq_len"),
                         ("seed", "resume with the same seed (data.seed / training seed)"),
                         ("sources", "resume with the same data files, or start a new run")):
            if sd[key] != lay[key] and not (key == "sources" and self.mixture is not None):
                saved, now = sd[key], lay[key]
                if key == "sources":
                    saved, now = f"{len(saved)} shards", f"{len(now)} shards (changed: " \
                        f"{sorted(set(saved) ^ set(now))[:4]})"
                raise DataStateError(f"the checkpoint's data-loader state has {key} = {saved}, this run has "
                                     f"{now}: the data position cannot carry over; {fix}")
        same = all(sd[k] == lay[k] for k in ("dp_world", "local_batch_size", "num_workers"))
        if lay["sharding"] == "window":
            if same and not reweighted:
                self._loader.load_state_dict(sd["loader"])
                self._windows_base, self._steps = sd["windows_done"], 0
                self._batches_base = sd.get("batches_done", 0)
                self._start_stream = sd["global_stream"]
                return
            if not same:
                logger.warning("data: window-mode state saved at dp world %d x local batch %d (%d workers) resumes "
                               "at dp world %d x local batch %d (%d workers) from global window %d",
                               sd["dp_world"], sd["local_batch_size"], sd["num_workers"], lay["dp_world"],
                               lay["local_batch_size"], lay["num_workers"], sd["windows_done"])
            self._build(start_stream=sd["global_stream"])
            self._windows_base, self._steps, self._batches_base = sd["windows_done"], 0, 0
            return
        if same and sd["dp_rank"] == lay["dp_rank"]:
            if sd.get("first_epoch", 0) != self._first_epoch:  # a layout that began after a reshard
                self._build(start_epoch=sd["first_epoch"])
            self._loader.load_state_dict(sd["loader"])
            self._steps, self._batches_base = 0, sd.get("batches_done", 0)
            return
        if not self.cfg.allow_document_reshard:
            raise DataStateError(
                f"data-loader state saved with sharding='document' at dp world size {sd['dp_world']} (rank "
                f"{sd['dp_rank']}, {sd['num_workers']} workers, local batch {sd['local_batch_size']}) cannot continue "
                f"exactly at dp world size {lay['dp_world']} (rank {lay['dp_rank']}, {lay['num_workers']} workers, "
                f"local batch {lay['local_batch_size']}): documents are assigned per rank and worker. Resume with "
                f"{sd['dp_world']} ranks and {sd['num_workers']} workers, or set data.allow_document_reshard=true to "
                f"start epoch {sd['epoch'] + 1} at the new layout (skipping the rest of epoch {sd['epoch']}), or use "
                f"data.sharding='window'.")
        logger.warning("data: document-mode state saved at dp world %d (%d workers) resumed at dp world %d "
                       "(%d workers) with data.allow_document_reshard: the rest of epoch %d is skipped, epoch %d "
                       "starts now", sd["dp_world"], sd["num_workers"], lay["dp_world"], lay["num_workers"],
                       sd["epoch"], sd["epoch"] + 1)
        self._build(start_epoch=sd["epoch"] + 1 if self.mixture is None
                    else [sd["epochs"][name] + 1 for name in self.mixture[0]])
        self._steps, self._batches_base = 0, 0

    def _check_mixture_state(self, sd: dict) -> None:
        """A mixture's state continues only a mixture of the same sources (files), and other
        weights only with ``data.allow_weight_change`` (DataStateError otherwise)."""
        saved = sd.get("weights")
        now = self.layout.get("weights")
        if (saved is None) != (now is None):
            what = ("a data mixture (data.sources)", "one source") if saved is not None else \
                ("one source", "a data mixture (data.sources)")
            raise DataStateError(f"the checkpoint's data-loader state is of {what[0]}, this run reads {what[1]}: the "
                                 f"data position cannot carry over; resume with the checkpoint's [data] form, or "
                                 f"start a new run")
        if now is None:
            return
        if list(saved) != list(now):
            raise DataStateError(f"the checkpoint's data mixture has sources {list(saved)}, this run has {list(now)}: "
                                 f"each source's position is saved under its name; resume with the same sources "
                                 f"(weight 0 keeps a source without drawing from it), or start a new run")
        for name in now:
            if sd["sources"][name] != self.layout["sources"][name]:
                changed = sorted(set(sd["sources"][name]) ^ set(self.layout["sources"][name]))[:4]
                raise DataStateError(f"the checkpoint's data mixture source {name!r} read other files (changed: "
                                     f"{changed}): its position cannot carry over; resume with the same files, "
                                     f"or start a new run")
        if saved != now:
            diff = ", ".join(f"{n} {saved[n]:.6g} -> {now[n]:.6g}" for n in now if saved[n] != now[n])
            if not self.cfg.allow_weight_change:
                raise DataStateError(f"the checkpoint's data mixture was drawn with other weights ({diff}, normalised): "
                                     f"set data.allow_weight_change = true to continue every source from its saved "
                                     f"position with the new weights (the next phase of an anneal), or resume with "
                                     f"the saved weights")
            logger.warning("data: mixture weights changed on resume (%s; data.allow_weight_change): every source "
                           "continues from its saved position", diff)


def build_train_loader(cfg: DataConfig, tokenizer, *, dp_rank: int, dp_world: int, local_batch_size: int,
                       seq_len: int, seed: int) -> TrainLoader:
    """The training loader of one data-parallel rank.

    Yields ``(inputs, labels)``, int64 tensors of shape ``(local_batch_size, seq_len)``.
    ``seed`` is the training seed, used when ``cfg.seed`` is None.
    Raises DataError for unreadable sources, ManifestError for pretokenized data made with
    another tokenizer, ValueError for a bad layout.
    """
    if not 0 <= dp_rank < dp_world:
        raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_world={dp_world})")
    if local_batch_size < 1 or seq_len < 1:
        raise ValueError(f"local_batch_size ({local_batch_size}) and seq_len ({seq_len}) must be >= 1")
    if cfg.is_mixture:
        shards = [train_shards(m.data) for m in cfg.mixture()]
        for source_shards in shards:
            _check_pretokenized(cfg, source_shards, tokenizer)
    else:
        shards = train_shards(cfg)
        _check_pretokenized(cfg, shards, tokenizer)
    return TrainLoader(cfg, shards, tokenizer, dp_rank=dp_rank, dp_world=dp_world,
                       local_batch_size=local_batch_size, seq_len=seq_len,
                       seed=cfg.seed if cfg.seed is not None else seed)


IGNORE_INDEX = -100
"""Label of a padding row in a validation micro-batch: the loss ignores it (``F.cross_entropy``'s default)."""


def validation_windows(shards: list, tokenizer, *, seq_len: int, sequences: int) -> list[list[int]]:
    """The validation set: the first ``sequences`` windows of ``seq_len + 1`` tokens of the held-out stream
    (files in listed order, no shuffling, packed like training data).

    Raises DataError when the files hold fewer windows, naming how many they hold and the largest
    ``validation.sequences`` they allow.
    """
    stream = TokenStream(shards, tokenizer.encode, tokenizer.eos_id, seq_len + 1, seed=0, shuffle=False,
                         shuffle_buffer=0, infinite=False, consumer=[])
    windows = []
    while len(windows) < sequences:
        w = stream.next_window()
        if w is None:
            files = ", ".join(s.name for s in shards[:3]) + (", ..." if len(shards) > 3 else "")
            if not windows:
                raise DataError(f"the validation files ({files}) hold fewer than {seq_len + 1} tokens, not one "
                                f"validation sequence of training.seq_len + 1 tokens: add validation files "
                                f"(data.validation_files) or set validation.enable = false")
            raise DataError(f"validation.sequences = {sequences}, but the validation files ({files}) hold only "
                            f"{len(windows)} sequences of {seq_len + 1} tokens: set validation.sequences to at "
                            f"most {len(windows)} (or validation.tokens to at most {len(windows) * seq_len}), "
                            f"or add validation files")
        windows.append(w)
    return windows


class ValidationLoader:
    """The validation set (``validation_windows``: a fixed set of ``sequences`` windows, so
    ``sequences * seq_len`` target tokens) as this rank's micro-batches.

    Rank r of W evaluates windows r, r + W, r + 2W, ... in micro-batches of ``local_batch_size``
    rows. Every rank yields the same number of micro-batches (``len(self)``; the model's forward is
    a collective under FSDP); rows past the rank's share are padding whose labels are all
    ``IGNORE_INDEX``. The summed loss over all ranks divided by the summed target count is thus the
    mean over the same tokens whatever the micro-batch size, gradient accumulation or world size
    (equal up to float summation order). Built and checked on construction; every evaluation sees
    identical tensors. Micro-batches are ``(inputs, labels)``, int64 ``(local_batch_size, seq_len)``.
    """

    def __init__(self, windows: list[list[int]], *, dp_rank: int, dp_world: int, local_batch_size: int):
        self.seq_len = len(windows[0]) - 1
        mine = torch.tensor(windows[dp_rank::dp_world], dtype=torch.int64).reshape(-1, len(windows[0]))
        per_rank = -(-len(windows) // dp_world)
        self.steps = -(-per_rank // local_batch_size)
        pad = self.steps * local_batch_size - mine.shape[0]
        inputs = torch.cat([mine[:, :-1], torch.zeros(pad, mine.shape[1] - 1, dtype=torch.int64)])
        labels = torch.cat([mine[:, 1:], torch.full((pad, mine.shape[1] - 1), IGNORE_INDEX, dtype=torch.int64)])
        self.target_tokens = len(windows) * (len(windows[0]) - 1)
        self._batches = [(inputs[i:i + local_batch_size].contiguous(), labels[i:i + local_batch_size].contiguous())
                         for i in range(0, inputs.shape[0], local_batch_size)]

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        return iter(self._batches)


def build_validation_sets(cfg: DataConfig, tokenizer, *, dp_rank: int, dp_world: int, local_batch_size: int,
                          seq_len: int, sequences: int) -> dict[str, ValidationLoader]:
    """This rank's validation sets by source name: ``{"": loader}`` for one source; for a mixture
    one set of ``sequences`` windows per source that has validation files (each source's own
    held-out files, read as ``build_validation_loader`` reads them; the same sets whatever the
    weights, so validation losses compare across the phases of an anneal).

    Raises:
        DataError: as ``build_validation_loader``, the message naming the source; no source
            with validation files.
    """
    if cfg.is_mixture and not cfg.validation_configs():
        raise DataError(NO_VALIDATION_SOURCE)
    out = {}
    for name, data in cfg.validation_configs() if cfg.is_mixture else [("", cfg)]:
        try:
            out[name] = build_validation_loader(data, tokenizer, dp_rank=dp_rank, dp_world=dp_world,
                                                local_batch_size=local_batch_size, seq_len=seq_len,
                                                sequences=sequences)
        except DataError as e:
            raise DataError(f"data.sources {name!r}: {e}" if name else str(e)) from e
    return out


def build_validation_loader(cfg: DataConfig, tokenizer, *, dp_rank: int, dp_world: int, local_batch_size: int,
                            seq_len: int, sequences: int) -> ValidationLoader:
    """This rank's micro-batches of the validation set: the first ``sequences`` windows of
    ``seq_len + 1`` tokens of ``cfg.validation_files`` (``ValidationLoader``).

    Needs no model: call it before building one, so a too-small validation set stops the job
    before anything expensive. Raises DataError if the files are missing, unreadable, or hold
    fewer than ``sequences`` windows (the message gives the largest value they allow); ValueError
    for ``sequences`` or ``local_batch_size`` < 1.
    """
    if sequences < 1 or local_batch_size < 1:
        raise ValueError(f"sequences ({sequences}) and local_batch_size ({local_batch_size}) must be >= 1")
    if cfg.is_mixture:
        raise ValueError("build_validation_loader reads one source; for a mixture use build_validation_sets")
    shards = validation_shards(cfg)
    _check_pretokenized(cfg, shards, tokenizer)
    windows = validation_windows(shards, tokenizer, seq_len=seq_len, sequences=sequences)
    return ValidationLoader(windows, dp_rank=dp_rank, dp_world=dp_world, local_batch_size=local_batch_size)
