//! A device's outcome (results per step and micro-batch, its report, its carried state) as a
//! sequence of arrays, so that a process-spanning transport can bring it to device 0: first
//! one string array holding the names and the report as JSON, then the arrays in order.

use ir::DType;
use ir::eval::{Array, Data};
use serde::{Deserialize, Serialize};

use super::{DeviceOutcome, DeviceReport};

#[derive(Serialize, Deserialize)]
struct Meta {
    /// Per step, per micro-batch, the names of the results.
    steps: Vec<Vec<Vec<String>>>,
    report: DeviceReport,
    /// The carried state's names.
    state: Vec<String>,
}

/// The outcome as arrays: the meta array, then every result, then the state.
pub(crate) fn encode(o: &DeviceOutcome) -> Vec<Array> {
    let (steps, report, state) = o;
    let meta = Meta {
        steps: steps.iter().map(|s| s.iter().map(|m| m.iter().map(|(n, _)| n.clone()).collect()).collect()).collect(),
        report: report.clone(),
        state: state.iter().map(|(n, _)| n.clone()).collect(),
    };
    let json = serde_json::to_string(&meta).expect("meta serializes");
    let mut out = vec![Array { dtype: DType::String, shape: vec![1], data: Data::Str(vec![json]) }];
    for s in steps {
        for m in s {
            out.extend(m.iter().map(|(_, a)| a.clone()));
        }
    }
    out.extend(state.iter().map(|(_, a)| a.clone()));
    out
}

/// The outcome back from its arrays, `take(i)` giving the `i`-th.
pub(crate) fn decode(mut take: impl FnMut(usize) -> Result<Array, String>) -> Result<DeviceOutcome, String> {
    let first = take(0)?;
    let Data::Str(v) = &first.data else { return Err("a device's outcome did not start with its description".into()) };
    let meta: Meta = serde_json::from_str(v.first().map(|s| s.as_str()).unwrap_or(""))
        .map_err(|e| format!("a device's outcome is garbled: {e}"))?;
    let mut i = 1;
    let mut next = |name: &String| -> Result<(String, Array), String> {
        let a = take(i)?;
        i += 1;
        Ok((name.clone(), a))
    };
    let mut steps = Vec::with_capacity(meta.steps.len());
    for s in &meta.steps {
        let mut micro = Vec::with_capacity(s.len());
        for m in s {
            micro.push(m.iter().map(&mut next).collect::<Result<Vec<_>, _>>()?);
        }
        steps.push(micro);
    }
    let state = meta.state.iter().map(&mut next).collect::<Result<Vec<_>, _>>()?;
    Ok((steps, meta.report, state))
}

#[cfg(test)]
mod tests {
    #[test]
    fn outcomes_round_trip() {
        let a = |x: f32| ir::eval::Array::f32(vec![2], vec![x, x + 1.0]);
        let report = super::DeviceReport { device: 3, adapter: "cpu".into(), wall_s: 0.5, ..Default::default() };
        let o = (
            vec![vec![vec![("loss".to_string(), a(1.0))], vec![("loss".to_string(), a(2.0))]]],
            report,
            vec![("w".to_string(), a(3.0))],
        );
        let arrays = super::encode(&o);
        assert_eq!(arrays.len(), 4);
        let back = super::decode(|i| Ok(arrays[i].clone())).unwrap();
        assert_eq!(back.0, o.0);
        assert_eq!(back.2, o.2);
        assert_eq!((back.1.device, back.1.wall_s), (3, 0.5));
    }
}
