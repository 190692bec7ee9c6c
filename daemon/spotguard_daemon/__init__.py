"""spotguard daemon: watches the platform, delivers notices, makes checkpoints durable."""
