"""Examples that use spotguard; installed as ``spotguard_examples`` so ``spotguard demo`` can run them."""
