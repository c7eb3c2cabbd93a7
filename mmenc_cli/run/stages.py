"""The decode -> batch -> encode -> write machinery of one run (`Stages`), built on first use:
the encode stage with its shard committer, the text feed, and the media feed with its decode pool.
`pipeline.EncodeRun`'s row loop hands it items; what it needs of the run comes as one
`RunContext`."""

from __future__ import annotations

from ..encoders.base import Encoder
from ..errors import MMError
from ..records import MEDIA, Item
from ..stopping import Interrupted
from ..writers import make_writer
from .commit import ShardCommitter
from .context import RunContext
from .decode_pool import DecodePool
from .decode_worker import Preprocessors
from .encode_stage import EncodeStage
from .media_feed import CHUNK, MediaFeed, device_decoder
from .texts import TextFeed


class Stages:
    """The decode -> batch -> encode -> write machinery of one run, built on first use."""

    def __init__(self, run: RunContext) -> None:
        self.run, self.cfg = run, run.cfg
        self.stage: EncodeStage | None = None
        self.texts: TextFeed | None = None
        self.media: MediaFeed | None = None

    def _ready(self) -> EncodeStage:
        if self.stage is not None:
            return self.stage
        run, cfg = self.run, self.cfg
        encoder = run.load_encoder()
        # without --batch-size the encoder may choose for its device (a probe on CUDA): not in the fingerprint
        choice = None if cfg.batch.batch_size is not None else encoder.default_batch_size(run.modalities)
        run.batch_size = cfg.batch.size_for(choice)
        keep = tuple(cfg.manifest.keep)
        writer = make_writer(cfg.writer.format, run.facts, run.facts["out_dtype"], keep)
        committer = ShardCommitter(run.output, writer, cfg.writer.shard_size, keep, after_commit=run.failures.sync)
        self.stage = EncodeStage(encoder, run.batch_size, cfg.batch.grow_after, bool(run.facts.get("normalize")),
                                 run.counters, run.failures, committer, run.events, run.progress)
        return self.stage

    def _text_feed(self) -> TextFeed:
        if self.texts is None:
            stage = self._ready()
            self.texts = TextFeed(stage.encoder, stage.batch_size, self.run.counters,
                                  lambda items, payloads: stage("text", items, payloads), self.run.stop)
        return self.texts

    def _media_feed(self) -> MediaFeed:
        if self.media is None:
            stage = self._ready()
            encoder, batch, size = stage.encoder, self.cfg.batch, stage.batch_size
            workers = batch.workers_per_device(len(self.cfg.model.devices))
            in_flight = max(size * batch.prefetch_batches, 2 * CHUNK * workers)  # every worker busy
            frames = self.cfg.media.frames_per_clip()
            pre = self._preprocessors(encoder, frames)
            make_pool = lambda: DecodePool(pre, self.cfg.media, workers, max_in_flight=in_flight,  # noqa: E731
                                           stop=self.run.stop, slots=in_flight + CHUNK + size,
                                           idle=self._idle, fetch_bytes=batch.max_inflight_bytes // max(1, workers))
            asked = set(self.run.modalities)
            sizes = {"image": size, "audio": size, "video": max(1, size // frames)}
            # a worker holds its chunk whole, and so does the chunk's pickled copy on its way there:
            # chunks of large members are cut at a quarter of a worker's share of the bytes budget
            chunk_bytes = max(1, batch.max_inflight_bytes // (4 * max(1, workers)))
            self.media = MediaFeed(make_pool, sizes, batch.max_batch_tokens, self.run.counters, self.run.failures,
                                   stage, device_decode=device_decoder(self.cfg, encoder) if "image" in asked else None,
                                   max_bytes=batch.max_inflight_bytes, chunk_bytes=chunk_bytes)
        return self.media

    def _idle(self) -> None:
        """Before the loop waits for its decode workers: launch what the device has decoded, then
        account for the group in flight."""
        if self.media is not None:
            self.media.idle()
        if self.stage is not None:
            self.stage.flush()

    def _preprocessors(self, encoder: Encoder, frames: int) -> Preprocessors:
        """The workers' preprocessing, only for what this run encodes (a VL model's video processor
        imports torch in every worker); under `--decode fast` (and for what `--decode gpu` leaves
        to the CPU) the image preprocessor's fast variant."""
        asked = set(self.run.modalities)
        image = encoder.image_preprocessor() if asked & {"image", "video"} else None
        if image is not None and self.cfg.media.decode in ("fast", "gpu"):
            image = image.for_fast_decode()
        return Preprocessors(image=image, audio=encoder.audio_preprocessor() if "audio" in asked else None,
                             video=encoder.video_preprocessor() if "video" in asked else None, frames=frames)

    def add(self, item: Item) -> None:
        """Accept one pending item (not attempted when a stop interrupts the model's loading)."""
        try:
            self._add(item)
        except Interrupted:
            self.run.counters.add(item.modality, "not_attempted")
            raise

    def _add(self, item: Item) -> None:
        if item.modality in MEDIA:
            self._media_feed().add(item)
            return
        text = item.row.text or ""
        if not text.strip():
            self.run.failures.record(MMError("text is empty after stripping whitespace", stage="validate",
                                             reason="text.empty"), item.row, "text")
            return
        feed = self._text_feed()
        prefix = self.cfg.model.text_prefix
        limit = self.stage.encoder.max_text_chars if self.stage is not None else None
        if limit is not None and len(prefix) + len(text) > limit:  # bounded work per item
            feed.add(Item(item.row, item.modality, cut=True), (prefix + text[:limit])[:limit])
        else:
            feed.add(item, prefix + text)

    def pump(self) -> None:
        """Encode whatever is ready: full text windows, finished decodes, full image batches."""
        if self.texts is not None:
            self.texts.pump()
        if self.media is not None:
            self.media.pump()

    def finish(self, interrupted: bool) -> None:
        """Flush everything; when interrupted, commit what is encoded and count the rest as not attempted."""
        feeds = [f for f in (self.media, self.texts) if f is not None]
        try:
            for feed in feeds:
                if not interrupted:
                    feed.finish()
                if self.run.stop.is_set():  # stopped now or during the flush
                    self._dropped(feed)
            if self.stage is not None:
                self.stage.finish()
        finally:
            for feed in feeds:
                feed.close()

    def _dropped(self, feed: MediaFeed | TextFeed) -> None:
        """Count what a feed gives up as not attempted."""
        for modality, n in feed.drop().items():
            self.run.counters.add(modality, "not_attempted", n)

    def abandon(self) -> None:
        """After a fault of the output: count everything not committed as not attempted, stop."""
        for feed in (self.media, self.texts):
            if feed is not None:
                self._dropped(feed)
        if self.stage is not None:
            self.stage.abandon()

    def abort(self) -> None:
        """Stop workers and the writer thread after an unexpected error."""
        for feed in (self.texts, self.media):
            if feed is not None:
                feed.close()
        if self.media is not None:
            self.media.close(kill=True)
        if self.stage is not None:
            self.stage.abort()
