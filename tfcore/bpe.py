"""Byte-level BPE written out (chapter 24): GPT-2's tokenizer, trained and applied from scratch.

Byte-pair encoding (Gage, 1994; Sennrich et al., 2016) on the bytes of UTF-8 text, as in GPT-2
(Radford et al., 2019):

1. the alphabet is the 256 bytes, each written as one printable character (``bytes_to_unicode``:
   the space byte 0x20 is ``Ġ``), so that a token is a string and no text is ever unknown;
2. the text is cut into words by GPT-2's pattern (``GPT2_PATTERN``): a word keeps the space before it;
3. training counts every adjacent pair of symbols over the words, weighted by how often each word
   occurs, merges the most frequent pair into a new symbol, and repeats until the vocabulary is full;
4. encoding spells a word in bytes and applies the learned merges in the order they were learned
   (their *rank*); decoding joins the tokens' strings and maps each character back to its byte.

Conventions follow the ``tokenizers`` library's byte-level BPE trainer (0.23), so that both give the
same merges and ids: special tokens take the first ids, the 256 bytes the next ones in the order of
their printable characters' code points, then each merge one id in the order it was learned; a tie
between equally frequent pairs goes to the pair of smaller ids ``(left id, right id)``; training stops
when the best pair is seen fewer than ``min_frequency`` times; a special token written in a training
text is counted there as ordinary text (encoding never splits it).

``train`` updates the pair counts only in the words a merge touched; ``train_naive`` recounts every
pair after every merge (same merges, slower; chapter 24 times both).
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict

import regex

# GPT-2's pre-tokenisation: contractions, an optional space then letters, then digits, then other
# symbols; runs of white space (the last space of a run stays with the word that follows).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

Pair = tuple[int, int]


def bytes_to_unicode() -> dict[int, str]:
    """The 256 bytes -> 256 printable characters (GPT-2's ``bytes_to_unicode``).

    A byte that is a printable, non-space Latin-1 character stands for itself (``"A"`` is byte 65);
    the 68 others (controls, the space, 0x7F-0xA0, 0xAD) take the characters 256, 257, ... in byte
    order: byte 0x20, the space, becomes ``"Ġ"`` (U+0120).
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


BYTE_TO_CHAR = bytes_to_unicode()
CHAR_TO_BYTE = {char: byte for byte, char in BYTE_TO_CHAR.items()}


def _check_text(text) -> str:
    if not isinstance(text, str):
        raise TypeError(f"a tokenizer reads text (str), got {type(text).__name__}; decode bytes first, "
                        f"e.g. data.decode('utf-8')")
    return text


def pre_tokenize(text: str, pattern: str = GPT2_PATTERN) -> list[str]:
    """Cut ``text`` into words with ``pattern`` and write each word's UTF-8 bytes as printable
    characters: ``"Hi there"`` -> ``["Hi", "Ġthere"]``."""
    _check_text(text)
    return ["".join(BYTE_TO_CHAR[b] for b in word.encode("utf-8")) for word in regex.findall(pattern, text)]


def count_pairs(words: list[list[int]], counts: list[int]) -> Counter:
    """How often each adjacent pair ``(left id, right id)`` occurs, over ``words`` (each a list of
    symbol ids) weighted by ``counts`` (how often each word occurs in the text)."""
    pairs = Counter()
    for word, count in zip(words, counts):
        for pair in zip(word, word[1:]):
            pairs[pair] += count
    return pairs


def merge_word(word: list, pair: tuple, new) -> list:
    """Replace each occurrence of ``pair`` in ``word``, from left to right, by ``new``
    (``[a, a, a]`` with the pair ``(a, a)`` -> ``[aa, a]``). Symbols are ids when training, strings
    when encoding."""
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(new)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


class ByteLevelBPE:
    """A trained byte-level BPE: ``vocab`` (id -> token string), ``merges`` (pairs of token strings,
    by rank) and ``special_tokens`` (never split, ids ``0 .. n-1``).

    ``encode(text)`` -> ids, ``decode(ids)`` -> text; ``decode(encode(s)) == s`` for every string ``s``.
    Checked when built: the tokens are distinct strings, the vocabulary holds the 256 byte characters
    and the special tokens, and each merge is a pair of tokens whose parts and join are in it.
    """

    def __init__(self, vocab: list[str], merges: list[tuple[str, str]], special_tokens=(),
                 pattern: str = GPT2_PATTERN, cache: bool = True):
        if isinstance(vocab, str) or isinstance(special_tokens, str):
            raise TypeError("vocab and special_tokens must be lists of token strings, not one string")
        self.vocab = list(vocab)
        self.token_to_id = {token: i for i, token in enumerate(self.vocab)}
        if not all(isinstance(token, str) and token for token in self.vocab) \
                or len(self.token_to_id) != len(self.vocab):
            raise ValueError("vocab must list distinct, non-empty token strings (its index is the id)")
        self.merges = [tuple(pair) if isinstance(pair, (tuple, list)) else pair for pair in merges]
        for rank, pair in enumerate(self.merges):
            if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
                raise ValueError(f"merge {rank} must be a pair of token strings (left, right), got {pair!r}")
            missing = [t for t in (*pair, pair[0] + pair[1]) if t not in self.token_to_id]
            if missing:
                raise ValueError(f"merge {rank} {pair!r}: {', '.join(map(repr, missing))} not in the vocabulary; "
                                 f"each merge's two parts and their join must be tokens of vocab")
        absent = [char for char in BYTE_TO_CHAR.values() if char not in self.token_to_id]
        if absent:
            raise ValueError(f"vocab lacks {len(absent)} of the 256 byte characters (e.g. {absent[0]!r}): a "
                             f"byte-level BPE spells any text in bytes; start vocab from bytes_to_unicode()")
        unknown = [token for token in special_tokens if token not in self.token_to_id]
        if unknown:
            raise ValueError(f"special tokens {unknown} are not in the vocabulary: give each an id in vocab")
        self.ranks = {pair: rank for rank, pair in enumerate(self.merges)}  # pair of strings -> rank
        self.special_tokens = list(special_tokens)
        self.pattern = pattern
        self.cache = {} if cache else None
        # Special tokens are cut out of the text before pre-tokenisation, the longest tried first.
        longest_first = sorted(self.special_tokens, key=len, reverse=True)
        self._special = regex.compile("(" + "|".join(map(regex.escape, longest_first)) + ")") if longest_first else None

    def encode_word(self, word: str) -> list[str]:
        """One pre-tokenised word (printable characters) -> its tokens: apply the merge of lowest rank
        among the adjacent pairs, everywhere in the word, until no pair is a merge."""
        if self.cache is not None and word in self.cache:
            return self.cache[word]
        symbols = list(word)
        while len(symbols) > 1:
            pairs = set(zip(symbols, symbols[1:]))
            best = min(pairs, key=lambda pair: self.ranks.get(pair, float("inf")))
            if best not in self.ranks:
                break
            symbols = merge_word(symbols, best, best[0] + best[1])
        if self.cache is not None:
            self.cache[word] = symbols
        return symbols

    def tokens(self, text: str) -> list[str]:
        """``text`` -> token strings (special tokens as written)."""
        _check_text(text)
        pieces = self._special.split(text) if self._special else [text]
        out = []
        for piece in pieces:
            if piece in self.special_tokens:
                out.append(piece)
            elif piece:
                for word in pre_tokenize(piece, self.pattern):
                    out.extend(self.encode_word(word))
        return out

    def encode(self, text: str) -> list[int]:
        """``text`` -> token ids."""
        return [self.token_to_id[token] for token in self.tokens(text)]

    def decode(self, ids) -> str:
        """Token ids -> text: join the tokens, map each character back to its byte, read UTF-8."""
        ids = [int(i) for i in ids]
        if any(not 0 <= i < len(self.vocab) for i in ids):
            raise ValueError(f"token ids must lie in 0..{len(self.vocab) - 1}")
        out, pending = [], []
        for i in ids:
            token = self.vocab[i]
            if token in self.special_tokens:
                out.append(bytes(pending).decode("utf-8", errors="replace") + token)
                pending = []
            else:
                pending.extend(CHAR_TO_BYTE[c] for c in token)
        out.append(bytes(pending).decode("utf-8", errors="replace"))
        return "".join(out)


def _prepare(texts, vocab_size: int, min_frequency: int, special_tokens, pattern: str, cut_special: bool = False):
    """Count the words of ``texts``; build the first vocabulary (special tokens, then the 256 bytes by
    code point); spell each distinct word as a list of byte ids. Returns ``(vocab, words, counts)``.

    Like the library's trainer, a special token written in a training text is counted as ordinary
    text; ``cut_special=True`` cuts it out first."""
    if isinstance(texts, str):
        raise TypeError("texts must be a list of strings (documents), not one string: wrap it, [text]")
    special_tokens = list(special_tokens)
    if int(vocab_size) != vocab_size or vocab_size < 256 + len(special_tokens):
        raise ValueError(f"vocab_size must be at least 256 (the bytes) + {len(special_tokens)} special "
                         f"token(s) = {256 + len(special_tokens)}, got {vocab_size}")
    if int(min_frequency) != min_frequency or min_frequency < 0:
        raise ValueError(f"min_frequency must be a whole number >= 0, got {min_frequency}")
    word_counts = Counter()
    for text in texts:
        for piece in (regex.split("|".join(map(regex.escape, special_tokens)), _check_text(text))
                      if special_tokens and cut_special else [_check_text(text)]):
            word_counts.update(pre_tokenize(piece, pattern))
    vocab = special_tokens + sorted(BYTE_TO_CHAR.values())  # the bytes in code-point order
    token_to_id = {token: i for i, token in enumerate(vocab)}
    words = [[token_to_id[c] for c in word] for word in word_counts]
    return vocab, words, list(word_counts.values())


def train_naive(texts, vocab_size: int, min_frequency: int = 0, special_tokens=(),
                pattern: str = GPT2_PATTERN, max_merges: int | None = None, return_stats: bool = False):
    """Teaching trainer: after every merge, recount every pair in every word (``count_pairs``).
    ``max_merges`` stops early (to time the first merges). With ``return_stats`` also returns
    ``{"visited": [...]}``: the pair positions counted before each merge (the work done)."""
    vocab, words, counts = _prepare(texts, vocab_size, min_frequency, special_tokens, pattern)
    merges, visited = [], []
    while len(vocab) < vocab_size and (max_merges is None or len(merges) < max_merges):
        pairs = count_pairs(words, counts)  # every pair of every word, again
        visited.append(sum(len(word) - 1 for word in words))
        if not pairs:
            break
        pair = min(pairs, key=lambda p: (-pairs[p], p))  # most frequent; a tie: smaller ids
        if pairs[pair] < max(min_frequency, 1):
            break
        vocab.append(vocab[pair[0]] + vocab[pair[1]])
        merges.append((vocab[pair[0]], vocab[pair[1]]))
        words = [merge_word(word, pair, len(vocab) - 1) for word in words]
    tokenizer = ByteLevelBPE(vocab, merges, special_tokens, pattern)
    return (tokenizer, {"visited": visited[:len(merges)]}) if return_stats else tokenizer


def apply_merge(words: list[list[int]], counts: list[int], pairs: Counter, where: dict, pair: Pair,
                new_id: int) -> tuple[set, int]:
    """Merge ``pair`` into ``new_id`` in the words that hold it (``where[pair]``, word indices), and
    update ``pairs`` (the pair counts) and ``where`` there only: each such word's old pairs are taken
    out and its new pairs put in, weighted by the word's count. Returns the pairs whose counts were
    put in, and how many pair positions were visited (the work done)."""
    touched, visited = set(), 0
    for w in where.pop(pair, ()):
        word, count = words[w], counts[w]
        old_pairs = list(zip(word, word[1:]))
        for old in old_pairs:  # take the word's pairs out ...
            pairs[old] -= count
        words[w] = word = merge_word(word, pair, new_id)
        new_pairs = list(zip(word, word[1:]))
        for new in new_pairs:  # ... and put its new pairs in
            pairs[new] += count
            where[new].add(w)
            touched.add(new)
        for gone in set(old_pairs) - set(new_pairs) - {pair}:
            where[gone].discard(w)
        visited += len(old_pairs) + len(new_pairs)
    return touched, visited


def train(texts, vocab_size: int, min_frequency: int = 0, special_tokens=(),
          pattern: str = GPT2_PATTERN, tie_break: str = "ids", cut_special: bool = False,
          return_stats: bool = False):
    """Incremental trainer: count the pairs once; after a merge, update the counts only in the words
    that held the merged pair (``apply_merge``), and find the next best pair in a heap.

    The heap holds ``(-count, tie key, pair)``; an entry whose count is out of date is put back with
    the current count when it reaches the top. ``tie_break="ids"`` (the library's rule) prefers the
    pair of smaller ids among equally frequent pairs; ``"strings"`` the pair of smaller token strings.
    ``cut_special=True`` keeps special tokens written in the training texts out of the counts (the
    library counts their characters as ordinary text).
    With ``return_stats`` also returns a dict of lists, one entry per merge: ``count`` (how often the
    merged pair occurred) and ``visited`` (pair positions visited to update the counts).
    """
    if tie_break not in ("ids", "strings"):
        raise ValueError(f"tie_break must be 'ids' (the library's rule) or 'strings', got {tie_break!r}")
    vocab, words, counts = _prepare(texts, vocab_size, min_frequency, special_tokens, pattern, cut_special)
    tie = (lambda pair: pair) if tie_break == "ids" else (lambda pair: (vocab[pair[0]], vocab[pair[1]]))
    pairs = count_pairs(words, counts)
    where = defaultdict(set)  # pair -> indices of the words that hold it
    for w, word in enumerate(words):
        for pair in zip(word, word[1:]):
            where[pair].add(w)
    heap = [(-count, tie(pair), pair) for pair, count in pairs.items()]
    heapq.heapify(heap)
    merges, stats = [], {"count": [], "visited": []}
    while len(vocab) < vocab_size and heap:
        negative, _, pair = heapq.heappop(heap)
        if -negative != pairs[pair]:  # out of date: put it back with its current count
            if pairs[pair] > 0:
                heapq.heappush(heap, (-pairs[pair], tie(pair), pair))
            continue
        if pairs[pair] < max(min_frequency, 1):
            break
        vocab.append(vocab[pair[0]] + vocab[pair[1]])
        merges.append((vocab[pair[0]], vocab[pair[1]]))
        stats["count"].append(pairs[pair])
        touched, visited = apply_merge(words, counts, pairs, where, pair, len(vocab) - 1)
        stats["visited"].append(visited)
        for new in touched:  # a count that went up needs a fresh entry; a stale one is fixed on top
            if pairs[new] > 0:
                heapq.heappush(heap, (-pairs[new], tie(new), new))
    tokenizer = ByteLevelBPE(vocab, merges, special_tokens, pattern)
    return (tokenizer, stats) if return_stats else tokenizer
