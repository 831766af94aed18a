"""The event vocabulary: a declared tensor's bytes, and the values events are."""

from memcalc.engine.program import Role, Tensor, cublas, new


def test_new_declares_what_tensor_makes():
    """``new`` builds the tuple itself (faster than the class call); it must be the same
    tensor, bytes included: 8 x 1 x 64 x 64 fp32 = 32,768 x 4 B = 131,072 B."""
    declared = new("S0", [8, 1, 64, 64], "float32", Role.saved, "tril")
    made = Tensor("S0", (8, 1, 64, 64), "float32", Role.saved, "tril")
    assert declared == made and type(declared) is Tensor
    assert declared.shape == (8, 1, 64, 64) and declared.bytes == 131_072


def test_new_counts_the_element_size():
    assert new("h", (3, 5), "float16", Role.temporary, "mm").bytes == 30  # 15 x 2 B
    assert new("i", (3, 5), "int64", Role.temporary, "argmax").bytes == 120  # 15 x 8 B


def test_storage_bytes_override_the_dense_size():
    """A traced view's storage may be larger than its shape (``storage_bytes``)."""
    assert Tensor("v", (4,), "float32", Role.activation, "view", storage_bytes=64).bytes == 64


def test_cublas_is_one_value():
    assert cublas() is cublas() and cublas() == cublas()
