"""A disk-log writer process for tests/test_storage.py: appends batches and says which are persisted.

python tests/storage_writer.py DIR POLICY stream      print "acked N" after each persisted batch, forever
python tests/storage_writer.py DIR POLICY fill        write until the disk is full, then read back:
                                                      print "full N" and "recovered M"
"""

from __future__ import annotations

import sys
from pathlib import Path

from broker.storage import DiskStore, FsyncPolicy, StorageFull, TopicMeta
from broker.store import Retention, TopicStore
from overlay.pubsub import Record

BATCH = 50
PAYLOAD = b"x" * 100


def store_fill(directory: Path, policy: FsyncPolicy) -> int:
    store = TopicStore(Retention(None, None), DiskStore(directory, policy, segment_bytes=64 * 1024))
    log = store.ensure("grid/feeder-1/voltage", (0.5, 0.5), (0.5, 0.5))
    n = 0
    while True:
        try:
            for i in range(BATCH):
                log.append(Record(1000.0 + (n + i) * 1e-3, "pub-1", n + i, PAYLOAD), 1000.0)
            log.persist()
        except StorageFull as exc:
            print(f"full {n} {len(log.rows)} {log.last_seq.get('pub-1', -1)} {exc}", flush=True)
            store.close()
            again = TopicStore(Retention(None, None), DiskStore(directory, policy, segment_bytes=64 * 1024))
            again.recover(1000.0)
            print(f"recovered {len(again.get('grid/feeder-1/voltage').rows)}", flush=True)
            return 0
        n += BATCH


def main() -> int:
    directory, policy, mode = Path(sys.argv[1]), FsyncPolicy.parse(sys.argv[2]), sys.argv[3]
    if mode == "store-fill":
        return store_fill(directory, policy)
    store = DiskStore(directory, policy, segment_bytes=64 * 1024)
    log = store.open_log(TopicMeta("grid/feeder-1/voltage", (0.5, 0.5), (0.5, 0.5)))
    n = 0
    while True:
        for i in range(BATCH):
            log.stage((1000.0 + (n + i) * 1e-3, "pub-1", n + i, PAYLOAD))
        try:
            log.persist()
        except StorageFull as exc:
            if mode != "fill":
                raise
            print(f"full {n} {exc}", flush=True)
            store.close()
            found, report = DiskStore(directory, policy, segment_bytes=64 * 1024).recover()
            print(f"recovered {len(found[0].rows)} {report}", flush=True)
            return 0
        n += BATCH
        if mode == "stream":
            print(f"acked {n}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
