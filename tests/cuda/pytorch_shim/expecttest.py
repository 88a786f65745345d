"""A minimal stand-in for the expecttest package, for running PyTorch's test files where it is
not installed (torch.testing._internal.common_utils derives its TestCase from
expecttest.TestCase). Inline expectations are compared, never rewritten."""
import unittest


def _normalize(text):
    lines = text.strip("\n").splitlines()
    indents = [len(l) - len(l.lstrip()) for l in lines if l.strip()]
    cut = min(indents) if indents else 0
    return "\n".join(l[cut:] for l in lines).strip()


class TestCase(unittest.TestCase):
    longMessage = True

    def assertExpectedInline(self, actual, expect, skip=0):
        self.assertEqual(_normalize(str(actual)), _normalize(expect))

    def assertExpectedRaisesInline(self, exc_type, callable, expect, *args, **kwargs):
        with self.assertRaises(exc_type) as cm:
            callable(*args, **kwargs)
        self.assertExpectedInline(str(cm.exception), expect)
