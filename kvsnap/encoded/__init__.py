"""Encoded snapshots (format version 3): a snapshot stored smaller, ``lossless`` (bit-exact) or
``fp8`` (e4m3 with per (block, head) scales, its error measured and recorded), still a
safetensors file (:mod:`kvsnap.format.encoded`).

* :mod:`~kvsnap.encoded.write`: :func:`~kvsnap.encoded.write.encode_file` turns an ordinary
  snapshot file into an encoded one (``kvsnap convert --compress``);
* :mod:`~kvsnap.encoded.capture`: ``capture(..., compression=)``, the encoded file written
  straight from the caches (:mod:`~kvsnap.encoded.cache_pages` gathers each layer tensor where
  it lies, :mod:`~kvsnap.encoded.page_digests` hashes it there), never the ordinary file;
* :mod:`~kvsnap.encoded.stored`: the stored tensors both writers make, the same way;
* :mod:`~kvsnap.encoded.read`: :func:`~kvsnap.encoded.read.read_encoded` checks one and
  :func:`~kvsnap.encoded.read.decode` turns it back into the ordinary file it stands for;
* :mod:`~kvsnap.encoded.opening`: that file in memory, for ``Snapshot.open`` (every reader of
  kvsnap then opens an encoded snapshot like any other; torch is imported only for fp8);
* :mod:`~kvsnap.encoded.path_restore`: ``Pipeline.restore(PATH)`` of an encoded file,
  registered with the pipeline when imported (``kvsnap.Pipeline`` imports it);
* :mod:`~kvsnap.encoded.original`: the ordinary file's side (layout, checks, tokens per block);
* :mod:`~kvsnap.encoded.fp8_pages`: fp8 layer tensors decoded on the host.

Nothing is imported here, so that opening a snapshot stays free of torch.
"""
