from deepserve.cache.radix_tree import RadixTree

BS = 4


def _chain(tree: RadixTree, tokens: list[int], first_block: int, salt=None):
    parent, nodes = tree.root(salt), []
    for i in range(len(tokens) // BS):
        node = tree.insert(parent, tuple(tokens[i * BS:(i + 1) * BS]), first_block + i)
        nodes.append(node)
        parent = node
    return nodes


def test_match_follows_full_blocks_only():
    tree = RadixTree(BS)
    _chain(tree, list(range(12)), 0)
    assert [n.block_id for n in tree.match(list(range(12)))] == [0, 1, 2]
    assert [n.block_id for n in tree.match(list(range(10)))] == [0, 1]  # partial 3rd block
    assert [n.block_id for n in tree.match([0, 1, 2, 3, 9, 9, 9, 9])] == [0]
    assert tree.match([5, 5, 5, 5]) == []
    assert [n.block_id for n in tree.match(list(range(12)), max_blocks=1)] == [0]


def test_salts_separate_tenants():
    tree = RadixTree(BS)
    _chain(tree, list(range(8)), 0, salt="tenant-a")
    assert tree.match(list(range(8)), salt="tenant-b") == []
    assert tree.match(list(range(8))) == []
    assert len(tree.match(list(range(8)), salt="tenant-a")) == 2


def test_evicts_unreferenced_leaves_lru_first():
    tree = RadixTree(BS)
    a = _chain(tree, [1] * 8, 10)          # blocks 10, 11
    b = _chain(tree, [2] * 8, 20)          # blocks 20, 21
    tree.acquire(a)
    tree.release(a)                        # a touched after b: b is older
    assert tree.num_unreferenced == 4
    assert tree.evict(1) == [21]           # b's leaf first
    assert tree.evict(2) == [20, 11]       # then b's root block, then a's leaf
    assert tree.num_nodes == 1 and tree.num_unreferenced == 1


def test_referenced_nodes_and_their_ancestors_survive():
    tree = RadixTree(BS)
    nodes = _chain(tree, list(range(12)), 0)
    tree.acquire(nodes[:2])
    assert tree.evict(10) == [2]
    assert [n.block_id for n in tree.match(list(range(12)))] == [0, 1]
    tree.release(nodes[:2])
    assert tree.clear() == [1, 0]
    assert tree.num_nodes == 0
