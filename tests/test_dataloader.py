"""Memory-mapped trees and tensorclasses as torch.utils.data datasets (memtree/dataset.py)."""

import os
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
from torch.utils.data import DataLoader, get_worker_info

import memtree
from memtree import BatchIndexSampler, MemoryMappedTensor

N = 48


@memtree.tensorclass(name="tests.dataloader.Image")
class Image:
    pixels: torch.Tensor
    label: torch.Tensor
    split: str = "train"


def source_images(n: int = N) -> Image:
    g = torch.Generator().manual_seed(0)
    return Image(
        torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8, generator=g),
        torch.arange(n) * 7 % 11,
        batch_size=[n],
    )


@pytest.fixture
def dataset(tmp_path):
    """A memmap_like dataset filled item by item (and a slice by index), loaded from disk."""
    src = source_images()
    data = Image(torch.zeros(3, 8, 8, dtype=torch.uint8), torch.zeros((), dtype=torch.int64))
    data = data.expand(N).memmap_like(tmp_path / "images")
    for i in range(N - 8):
        data[i] = src[i]
    data[torch.arange(N - 8, N)] = src[N - 8 :]
    return memtree.load_memmap(tmp_path / "images"), src


def assert_items_equal(got: Image, src: Image, order: torch.Tensor) -> None:
    assert type(got) is Image and got.batch_size == torch.Size([len(order)])
    assert torch.equal(got.pixels, src.pixels[order]) and torch.equal(got.label, src.label[order])
    assert got.split == "train"


def _check_worker_dataset(worker_id):
    """worker_init_fn: the worker's dataset maps the files; it is not a copy of the data."""
    data = get_worker_info().dataset
    for leaf in (data.pixels, data.label):
        assert isinstance(leaf, MemoryMappedTensor) and leaf.filename is not None, type(leaf)
        assert os.path.exists(leaf.filename)


# ------------------------------------------------------------------------------- single process


def test_items_are_records_of_the_dataset(dataset):
    data, src = dataset
    assert len(data) == N
    rec = data[5]
    assert type(rec) is Image and rec.batch_size == torch.Size([])
    assert isinstance(rec.pixels, MemoryMappedTensor)  # a view of the file: nothing copied
    assert torch.equal(rec.pixels, src.pixels[5])


def test_collate_stacks_records_and_passes_batches_through(dataset):
    data, src = dataset
    batch = memtree.collate([data[3], data[1], data[4]])
    assert_items_equal(batch, src, torch.tensor([3, 1, 4]))
    assert memtree.collate(batch) is batch


READS = {"__getitem__", "index_select", "take", "gather", "index", "__iter__", "unbind", "select"}


def test_getitems_reads_a_batch_with_one_index_per_leaf(dataset):
    data, src = dataset
    calls = []

    class CountIndexing(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func.__name__ in READS and any(isinstance(a, MemoryMappedTensor) for a in args):
                calls.append((func.__name__, args[0].filename))
            return func(*args, **(kwargs or {}))

    with CountIndexing():
        batch = data.__getitems__([9, 2, 30, 2])
    assert sorted(calls) == sorted([("index_select", data.pixels.filename), ("index_select", data.label.filename)])
    assert_items_equal(batch, src, torch.tensor([9, 2, 30, 2]))


def test_batch_index_sampler_covers_every_item_once():
    sampler = BatchIndexSampler(10, 4, shuffle=True, generator=torch.Generator().manual_seed(1))
    batches = list(sampler)
    assert len(batches) == len(sampler) == 3 and [len(b) for b in batches] == [4, 4, 2]
    assert sorted(torch.cat(batches).tolist()) == list(range(10))
    assert all(torch.equal(b, b.sort().values) for b in batches)  # sorted: reads in file order
    assert len(BatchIndexSampler(10, 4, drop_last=True)) == 2
    assert [len(b) for b in BatchIndexSampler(10, 4, drop_last=True)] == [4, 4]
    with pytest.raises(ValueError):
        BatchIndexSampler(10, 0)


def test_batch_index_sampler_reads_a_growing_length_each_epoch(tmp_path):
    buf = memtree.TensorTree({"x": torch.zeros(0)}, batch_size=[0]).memmap(tmp_path / "b")
    sampler = BatchIndexSampler(buf, 4)
    assert list(sampler) == []
    buf.extend_({"x": torch.arange(6.0)})
    assert [b.tolist() for b in sampler] == [[0, 1, 2, 3], [4, 5]]


def test_dataset_pickles_as_file_references(dataset):
    data, src = dataset
    payload = ForkingPickler.dumps(data)
    assert len(payload) < 4096 < data.pixels.numel()  # no pixel data inside
    back = ForkingPickler.loads(payload)
    assert type(back) is Image and back.pixels.filename == data.pixels.filename
    assert torch.equal(back.pixels, src.pixels)


# --------------------------------------------------------------------------------- with workers


def test_dataloader_two_fork_workers_read_every_item(dataset):
    data, src = dataset
    loader = DataLoader(data, batch_size=5, collate_fn=memtree.collate, num_workers=2,
                        multiprocessing_context="fork", worker_init_fn=_check_worker_dataset)
    batches = list(loader)
    assert [len(b) for b in batches] == [5] * 9 + [3]
    assert_items_equal(memtree.cat(batches), src, torch.arange(N))


def test_dataloader_fork_workers_send_back_single_records(dataset):
    data, src = dataset
    loader = DataLoader(data, batch_size=None, num_workers=2, multiprocessing_context="fork")
    records = list(loader)
    assert len(records) == N and all(type(r) is Image for r in records)
    assert_items_equal(memtree.stack(records), src, torch.arange(N))


@pytest.mark.slow
def test_batch_loader_spawn_worker_reads_every_item(dataset):
    """spawn pickles the dataset itself: it must travel as file references, not data."""
    data, src = dataset
    loader = memtree.batch_loader(
        data, 8, shuffle=True, generator=torch.Generator().manual_seed(3), num_workers=1,
        multiprocessing_context="spawn", worker_init_fn=_check_worker_dataset,
    )
    batches = list(loader)
    assert len(batches) == N // 8 and all(type(b) is Image for b in batches)
    order = torch.cat(list(BatchIndexSampler(N, 8, shuffle=True, generator=torch.Generator().manual_seed(3))))
    assert sorted(order.tolist()) == list(range(N))
    assert_items_equal(memtree.cat(batches), src, order)


def test_grown_buffer_records_travel_between_processes(tmp_path):
    """Files that hold spare capacity (longer than the tensors) still travel as file references.

    With batch_size=None, each worker sends back views of the mapped files, which the main
    process maps again; this works for a buffer grown here and for one loaded from disk.
    """
    buf = memtree.TensorTree({"obs": torch.zeros(0, 4), "act": torch.zeros(0, dtype=torch.int64)},
                             batch_size=[0]).memmap(tmp_path / "buf")
    for i in range(21):
        buf.append_({"obs": torch.full((4,), float(i)), "act": torch.tensor(i)})
    loaded = memtree.load_memmap(tmp_path / "buf")
    assert os.path.getsize(tmp_path / "buf" / "act.memmap") == 32 * 8  # capacity 32 > 21 rows
    for tree in (buf, loaded):
        records = list(DataLoader(tree, batch_size=None, num_workers=2, multiprocessing_context="fork"))
        assert all(isinstance(r["act"], MemoryMappedTensor) for r in records)
        got = memtree.stack(records)
        assert got["act"].tolist() == list(range(21))
        assert torch.equal(got["obs"][:, 3], torch.arange(21.0))


# ------------------------------------------------------------------------ default collate_fn


class RecordsDataset(torch.utils.data.Dataset):
    """A user dataset (no ``__getitems__``) whose items are trees among other values."""

    def __init__(self, data, wrap: bool = False):
        self.data, self.wrap = data, wrap

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        rec = self.data[i]
        return {"rec": rec, "index": i, "plain": memtree.TensorTree(rec.to_dict())} if self.wrap else rec


def test_default_collate_stacks_tree_items(dataset):
    data, src = dataset
    batches = list(DataLoader(RecordsDataset(data), batch_size=5))  # no collate_fn
    assert [len(b) for b in batches] == [5] * 9 + [3]
    assert_items_equal(memtree.cat(batches), src, torch.arange(N))
    assert torch.utils.data.default_collate([data[2], data[0]]).label.tolist() == src.label[[2, 0]].tolist()


def test_default_collate_trees_nested_in_items(dataset):
    data, src = dataset
    batch = next(iter(DataLoader(RecordsDataset(data, wrap=True), batch_size=4, shuffle=False)))
    assert batch["index"].tolist() == [0, 1, 2, 3]
    assert_items_equal(batch["rec"], src, torch.arange(4))
    plain = batch["plain"]
    assert type(plain) is memtree.TensorTree and plain.batch_size == torch.Size([4])
    assert torch.equal(plain["pixels"], src.pixels[:4]) and plain["split"] == "train"


def test_default_collate_with_getitems_of_the_tree(dataset):
    """The tree itself as dataset: ``__getitems__`` gives a batch tree, passed through as is."""
    data, src = dataset
    order = torch.randperm(N, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(data, batch_size=7, sampler=order.tolist())
    batches = list(loader)
    assert all(type(b) is Image for b in batches)
    assert_items_equal(memtree.cat(batches), src, order)


def test_default_collate_two_fork_workers(dataset):
    data, src = dataset
    for source in (data, RecordsDataset(data)):
        loader = DataLoader(source, batch_size=5, num_workers=2, multiprocessing_context="fork")
        batches = list(loader)
        assert all(type(b) is Image for b in batches) and [len(b) for b in batches] == [5] * 9 + [3]
        assert_items_equal(memtree.cat(batches), src, torch.arange(N))


def test_default_collate_batch_size_none_keeps_records(dataset):
    data, src = dataset
    records = list(DataLoader(RecordsDataset(data), batch_size=None))
    assert len(records) == N and all(type(r) is Image and r.batch_size == torch.Size([]) for r in records)
    assert_items_equal(memtree.stack(records), src, torch.arange(N))


def test_default_collate_plain_tree_records(tmp_path):
    tree = memtree.TensorTree({"x": torch.arange(12.0).reshape(6, 2), "n": {"y": torch.arange(6)}},
                              batch_size=[6]).memmap(tmp_path / "t")
    batch = next(iter(DataLoader(RecordsDataset(tree), batch_size=4)))
    assert type(batch) is memtree.TensorTree and batch.batch_size == torch.Size([4])
    assert batch["x"].tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]
    assert batch["n", "y"].tolist() == [0, 1, 2, 3]
    explicit = next(iter(DataLoader(RecordsDataset(tree), batch_size=4, collate_fn=memtree.collate)))
    assert (explicit == batch).all()
