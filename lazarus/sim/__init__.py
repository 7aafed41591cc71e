"""The simulation layer: `lazarus up` (a whole cluster on this machine) and fault injection
(chaos), which attaches to the components from outside through their seams."""
