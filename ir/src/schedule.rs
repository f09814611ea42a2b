//! Pipeline schedules: the order of forward and backward parts over the micro-batches, and the
//! closed forms of the bubble and of the micro-batches kept in flight. One type for the cost
//! model (its prices), the lowering and the runtime (their order of parts) and plan documents
//! (`"schedule": "1f1b"`).

/// The order of forward and backward parts over the micro-batches.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum Schedule {
    /// All micro-batch forwards, then all backwards.
    GPipe,
    /// One forward, one backward in the steady state.
    #[default]
    OneFOneB,
    /// Megatron's interleaved 1F1B: each device holds this many (≥ 2) model chunks (virtual
    /// stages), its layers round-robin over the devices.
    Interleaved(usize),
}

impl Schedule {
    /// `gpipe`, `1f1b` or `interleaved:V` (V ≥ 2 chunks per device).
    pub fn parse(s: &str) -> Option<Schedule> {
        match s {
            "gpipe" => Some(Schedule::GPipe),
            "1f1b" => Some(Schedule::OneFOneB),
            _ => {
                let v: usize = s.strip_prefix("interleaved:")?.parse().ok()?;
                (v >= 2).then_some(Schedule::Interleaved(v))
            }
        }
    }

    /// The schedule's name (`gpipe`, `1f1b`, `interleaved:V`), as strategy names and plan
    /// documents spell it and [`Schedule::parse`] reads it.
    pub fn name(self) -> String {
        match self {
            Schedule::GPipe => "gpipe".into(),
            Schedule::OneFOneB => "1f1b".into(),
            Schedule::Interleaved(v) => format!("interleaved:{v}"),
        }
    }

    /// Virtual stages (model chunks) per device: 1 but for the interleaved schedule.
    pub fn chunks(self) -> usize {
        match self {
            Schedule::Interleaved(v) => v.max(1),
            _ => 1,
        }
    }

    /// Micro-batches whose activations stage `s` (0-based) of `stages` keeps at once, in
    /// whole micro-batches of the stage's layers. Interleaved (Megatron's schedule): the
    /// device runs `2(S − s − 1) + (V − 1)S` chunk forwards before its first backward and
    /// holds one more in the steady state, each a V-th of its layers — stage 0 keeps
    /// `S + (S − 1)/V` micro-batches' worth (Korthikanti et al. 2022, §4.2.3).
    pub fn in_flight(self, s: usize, stages: usize, micro: usize) -> f64 {
        match self {
            Schedule::GPipe => micro as f64,
            Schedule::OneFOneB => micro.min(stages - s) as f64,
            Schedule::Interleaved(v) => {
                let chunks = 2 * (stages - s - 1) + (v - 1) * stages + 1;
                (chunks as f64 / v as f64).min(micro as f64)
            }
        }
    }

    /// Time slots of the step in per-micro-batch stage times: `M + S − 1`, the interleaved
    /// schedule's bubble a V-th of that, `M + (S − 1)/V`.
    pub fn slots(self, stages: usize, micro: usize) -> f64 {
        micro as f64 + (stages - 1) as f64 / self.chunks() as f64
    }

    /// Step time of the pipelined part from per-stage forward and backward times per
    /// micro-batch.
    pub fn makespan(self, fwd: &[f64], bwd: &[f64], micro: usize) -> f64 {
        let slots = self.slots(fwd.len(), micro);
        match self {
            Schedule::GPipe => {
                slots * (fwd.iter().copied().fold(0.0, f64::max) + bwd.iter().copied().fold(0.0, f64::max))
            }
            Schedule::OneFOneB | Schedule::Interleaved(_) => {
                slots * fwd.iter().zip(bwd).map(|(f, b)| f + b).fold(0.0, f64::max)
            }
        }
    }
}

impl serde::Serialize for Schedule {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.name())
    }
}

impl<'de> serde::Deserialize<'de> for Schedule {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Schedule, D::Error> {
        let s = String::deserialize(d)?;
        Schedule::parse(&s).ok_or_else(|| {
            serde::de::Error::custom(format!("the schedule `{s}` is not gpipe, 1f1b or interleaved:V (V ≥ 2)"))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::Schedule;

    #[test]
    fn names_parse_back_and_travel_as_json_strings() {
        for s in [Schedule::GPipe, Schedule::OneFOneB, Schedule::Interleaved(3)] {
            assert_eq!(Schedule::parse(&s.name()), Some(s));
            let json = serde_json::to_string(&s).unwrap();
            assert_eq!(json, format!("\"{}\"", s.name()));
            assert_eq!(serde_json::from_str::<Schedule>(&json).unwrap(), s);
        }
        assert_eq!(Schedule::parse("interleaved:1"), None);
        assert!(serde_json::from_str::<Schedule>("\"zigzag\"").unwrap_err().to_string().contains("zigzag"));
    }
}
